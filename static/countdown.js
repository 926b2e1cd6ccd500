// Counts the error page's wait down live; without JavaScript the page
// still says how long to wait and links back.
(function () {
  var box = document.querySelector('[data-countdown]');
  if (!box) return;
  var left = parseInt(box.getAttribute('data-countdown'), 10) || 0;
  var seconds = box.querySelector('[data-seconds]');
  var unit = box.querySelector('[data-unit]');
  var wait = box.querySelector('.wait');
  var ready = box.querySelector('.ready');
  var end = Date.now() + left * 1000;
  function tick() {
    left = Math.max(0, Math.ceil((end - Date.now()) / 1000));
    seconds.textContent = String(left);
    unit.textContent = left === 1 ? 'second' : 'seconds';
    if (left <= 0) {
      wait.hidden = true;
      ready.hidden = false;
      box.classList.add('done');
      var back = document.querySelector('[data-back]');
      if (back) {
        back.textContent = 'Try again';
        back.focus();
      }
      return;
    }
    setTimeout(tick, 250);
  }
  tick();
})();
