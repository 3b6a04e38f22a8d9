// A login link may carry the token in its fragment (#token=...), which browsers never send to a
// server: take it from there, wipe it from the address bar and history, and log in with it. (A
// link opened over the login page itself changes only the fragment: hence `hashchange` too.)
(function () {
  "use strict";
  function fromFragment() {
    var match = /^#token=([^&]+)/.exec(window.location.hash);
    if (!match) return;
    history.replaceState(null, "", window.location.pathname);
    document.getElementById("token").value = decodeURIComponent(match[1]);
    document.getElementById("login").submit();
  }
  window.addEventListener("hashchange", fromFragment);
  fromFragment();
})();
