// The desk's one script: the server sends a section's whole HTML whenever it changes (server-sent
// events on the URL in <body data-events>); swap it in. No data is computed here.
(function () {
  "use strict";
  var url = document.body.dataset.events;
  var live = document.getElementById("live");
  if (!url || !window.EventSource) return;
  var source = new EventSource(url);
  source.addEventListener("open", function () { if (live) live.className = "live on"; });
  source.addEventListener("error", function () { if (live) live.className = "live"; });
  source.addEventListener("section", function (event) {
    var section = JSON.parse(event.data);
    var element = document.getElementById(section.id);
    if (!element) return;
    element.innerHTML = section.html;
    element.setAttribute("data-updated", String(Date.now()));
  });
  source.addEventListener("problem", function (event) {
    if (live) { live.className = "live problem"; live.title = JSON.parse(event.data).message; }
  });
})();
