// Postal dashboard: live refresh of the page's #live part every few seconds, paused while the
// tab is hidden. Nothing else: every action is a plain form.
(function () {
  "use strict";
  var body = document.body;
  var seconds = Number(body.getAttribute("data-refresh") || 0);
  var state = document.getElementById("refresh-state");
  if (!seconds) { return; }
  var busy = false;
  function show(text) { if (state) { state.textContent = text; } }
  function refresh() {
    if (document.hidden || busy) { return; }
    busy = true;
    fetch(window.location.href, { headers: { "X-Postal-Refresh": "1" }, credentials: "same-origin" })
      .then(function (r) { if (!r.ok) { throw new Error("HTTP " + r.status); } return r.text(); })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var fresh = doc.getElementById("live");
        var live = document.getElementById("live");
        if (fresh && live) { live.innerHTML = fresh.innerHTML; }
        show("live · updated " + new Date().toLocaleTimeString());
      })
      .catch(function (e) { show("refresh failed: " + e.message); })
      .then(function () { busy = false; });
  }
  document.addEventListener("visibilitychange", function () {
    if (document.hidden) { show("paused (tab hidden)"); } else { refresh(); }
  });
  show("live");
  window.setInterval(refresh, seconds * 1000);
}());
