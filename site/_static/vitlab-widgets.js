// The widget manager typesets math in widget labels with MathJax 2's MathJax.Hub.Queue; the site
// serves MathJax 3, whose equivalent is MathJax.typesetPromise. Give the widgets that entry point.
(function () {
  function shim() {
    var mj = window.MathJax;
    if (!mj || mj.Hub) { return; }
    mj.Hub = {
      Queue: function (call) {
        var node = call && call[2];
        if (window.MathJax.typesetPromise) {
          window.MathJax.typesetPromise(node ? [node] : undefined).catch(function (err) {
            console.warn("MathJax could not typeset a widget label:", err);
          });
        }
      }
    };
  }
  shim();
  document.addEventListener("DOMContentLoaded", shim);
})();
