"""Renamed in vitlab 0.2: Grad-ECLIP, the method, lives in :mod:`vitlab.grad_eclip` (the old name
read as "grade CLIP"). Importing this module raises an ``ImportError`` that says so, for one release."""
raise ImportError("vitlab.gradeclip was renamed vitlab.grad_eclip: use `from vitlab.grad_eclip import grad_eclip`")
