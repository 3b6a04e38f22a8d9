// A login link may carry the token in its fragment (#token=...), which browsers never send to a
// server: take it from there, wipe it from the address bar and history, and log in with it.
(function () {
  "use strict";
  var match = /^#token=([^&]+)/.exec(window.location.hash);
  if (!match) return;
  history.replaceState(null, "", window.location.pathname);
  var form = document.getElementById("login");
  document.getElementById("token").value = decodeURIComponent(match[1]);
  form.submit();
})();
