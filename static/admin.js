// The operators' page: asks for the admin token once (kept in this tab's
// session storage), then shows what the admin API lists, every 5 seconds,
// with unban, reset, clear and override at hand. Everything is built with
// DOM calls (no HTML from data), and nothing is loaded from elsewhere.
(function () {
  "use strict";
  const KEY = "floodgate-admin-token";
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (css) => document.querySelector(css);
  let timer = null;

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    return e;
  }

  function secs(n) {
    if (n === null || n === undefined) return "never";
    if (n < 120) return n + " s";
    if (n < 7200) return Math.round(n / 60) + " min";
    if (n < 172800) return Math.round(n / 3600) + " h";
    return Math.round(n / 86400) + " d";
  }

  // The values an action takes, from an identity as its key holds it
  // (parts joined by "|", "|" and "%" escaped in them; an IPv6 address
  // by its /64); null for one that cannot be named (hashed).
  function valuesOf(id) {
    if (id.startsWith("~")) return null;
    if (id === "all") return [];
    const parts = id.includes("|") ? id.split("|") : [id];
    return parts.map((p) =>
      p.replace(/%7C/g, "|").replace(/%25/g, "%").replace(/::\/64$/, "::")
    );
  }

  async function api(method, path, body) {
    const res = await fetch("/admin/" + path, {
      method: method,
      headers: {
        Authorization: "Bearer " + sessionStorage.getItem(KEY),
        Accept: "application/json",
        "Content-Type": "application/json",
      },
      body: body ? JSON.stringify(body) : undefined,
    });
    if (res.status === 401) {
      sessionStorage.removeItem(KEY);
      showLogin("The token was refused; type it again:");
      throw new Error("token refused");
    }
    const data = await res.json().catch(() => ({}));
    if (!res.ok) throw new Error(data.error || "HTTP " + res.status);
    return data;
  }

  function showLogin(note) {
    if (timer) clearInterval(timer);
    timer = null;
    $("#admin-view").hidden = true;
    $("#admin-login").hidden = false;
    if (note) $("#admin-login-note").textContent = note;
    $("#admin-login input[name=token]").focus();
  }

  function showError(e) {
    const p = $("#admin-error");
    p.textContent = e ? String(e.message || e) : "";
    p.hidden = !e;
  }

  function button(label, run) {
    const b = el("button", label, "button secondary small");
    b.type = "button";
    b.addEventListener("click", async () => {
      b.disabled = true;
      try {
        await run();
        await refresh();
      } catch (e) {
        showError(e);
      } finally {
        b.disabled = false;
      }
    });
    return b;
  }

  function fill(table, rows, cells, actions) {
    const body = table.querySelector("tbody");
    body.replaceChildren();
    if (rows.length === 0) {
      const tr = el("tr", null, "empty");
      const td = el("td", "none");
      td.colSpan = table.querySelectorAll("th").length;
      tr.appendChild(td);
      body.appendChild(tr);
      return;
    }
    for (const row of rows) {
      const tr = el("tr");
      for (const c of cells(row)) tr.appendChild(el("td", c));
      const td = el("td", null, "actions");
      for (const b of actions ? actions(row) : []) td.appendChild(b);
      tr.appendChild(td);
      body.appendChild(tr);
    }
  }

  function act(action, row, extra) {
    const values = valuesOf(row.id);
    return api("POST", action, Object.assign({ rule: row.rule, values: values }, extra || {}));
  }

  // Horizontal bars: label, bar, count.
  function bars(title, rows) {
    const box = el("div", null, "bars");
    box.appendChild(el("h3", title));
    if (rows.length === 0) {
      box.appendChild(el("p", "no denial", "muted"));
      return box;
    }
    const shown = rows.slice(0, 10);
    const most = Math.max(...shown.map((r) => r.denied));
    const width = 320, line = 18;
    const drawing = svg("svg", {
      viewBox: "0 0 " + (width + 260) + " " + shown.length * line,
      width: width + 260, height: shown.length * line, role: "img",
    });
    shown.forEach((r, i) => {
      const label = svg("text", { x: 0, y: i * line + 13, class: "bar-label" });
      label.textContent = r.id.length > 28 ? r.id.slice(0, 27) + "…" : r.id;
      drawing.appendChild(label);
      drawing.appendChild(svg("rect", {
        x: 200, y: i * line + 3, height: line - 6,
        width: Math.max(2, (r.denied / most) * width), class: "deny-bar",
      }));
      const n = svg("text", { x: 206 + (r.denied / most) * width, y: i * line + 13, class: "bar-count" });
      n.textContent = r.denied;
      drawing.appendChild(n);
    });
    box.appendChild(drawing);
    return box;
  }

  // One line per rule: decisions per minute.
  function chart(data) {
    const box = el("div", null, "chart");
    const rules = Object.entries(data.rules || {});
    const n = (data.minutes || []).length;
    if (rules.length === 0 || n === 0) {
      box.appendChild(el("p", "no decision yet", "muted"));
      return box;
    }
    const W = 600, H = 160, most = Math.max(1, ...rules.flatMap(([, c]) => c));
    const drawing = svg("svg", { viewBox: "0 0 " + W + " " + (H + 20), width: W, height: H + 20, role: "img" });
    drawing.appendChild(svg("line", { x1: 0, y1: H, x2: W, y2: H, class: "axis" }));
    const x = (i) => (n === 1 ? W / 2 : (i / (n - 1)) * W);
    const legend = el("ul", null, "legend");
    rules.forEach(([name, counts], k) => {
      const points = counts.map((c, i) => x(i).toFixed(1) + "," + (H - (c / most) * (H - 10)).toFixed(1));
      const cls = "series s" + (k % 6);
      if (n === 1) {
        drawing.appendChild(svg("circle", { cx: x(0), cy: H - (counts[0] / most) * (H - 10), r: 4, class: cls }));
      } else {
        drawing.appendChild(svg("polyline", { points: points.join(" "), class: cls }));
      }
      const item = el("li", name + ": " + counts.reduce((a, b) => a + b, 0), cls);
      legend.appendChild(item);
    });
    const top = svg("text", { x: 2, y: 12, class: "bar-count" });
    top.textContent = most + "/min";
    drawing.appendChild(top);
    box.appendChild(drawing);
    box.appendChild(legend);
    return box;
  }

  let rules = [];

  async function refresh() {
    try {
      rules = await api("GET", "rules");
      const [bans, overrides, audit, decisions] = await Promise.all([
        api("GET", "bans"), api("GET", "overrides"), api("GET", "audit"), api("GET", "decisions"),
      ]);
      fill($("#bans"), bans,
        (b) => [b.rule, b.id, secs(b.banned_s), b.source, b.level],
        (b) => valuesOf(b.id) === null ? [] : [
          button("Unban", () => act("unban", b)),
          button("Reset", () => act("reset", b)),
        ]);
      fill($("#overrides"), overrides,
        (o) => [o.rule, o.id, o.limit, secs(o.window_s), o.expires_s === null ? "when cleared" : secs(o.expires_s)],
        (o) => valuesOf(o.id) === null ? [] : [button("Clear", () => act("override", o, { clear: true }))]);
      fill($("#audit"), audit.slice(0, 50),
        (a) => [a.at.replace("T", " ").replace("Z", ""), a.action, a.rule, a.id, a.by, a.detail]);
      const select = $("#override-form select");
      if (select.options.length !== rules.length) {
        select.replaceChildren(...rules.map((r) => { const o = el("option", r.name); o.value = r.name; return o; }));
      }
      const top = $("#top");
      const boxes = [];
      for (const r of rules.filter((r) => r.mode === "enforce")) {
        const [ten, hour] = await Promise.all([
          api("GET", "top?rule=" + encodeURIComponent(r.name) + "&since=10m"),
          api("GET", "top?rule=" + encodeURIComponent(r.name) + "&since=1h"),
        ]);
        if (ten.length === 0 && hour.length === 0) continue;
        const row = el("div", null, "top-rule");
        row.appendChild(el("h3", r.name));
        row.appendChild(bars("last 10 minutes", ten));
        row.appendChild(bars("last hour", hour));
        boxes.push(row);
      }
      top.replaceChildren(...(boxes.length ? boxes : [el("p", "no denial in the last hour", "muted")]));
      $("#decisions").replaceChildren(chart(decisions));
      $("#admin-updated").textContent = "Updated " + new Date().toLocaleTimeString();
      showError(null);
    } catch (e) {
      showError(e);
    }
  }

  function open() {
    $("#admin-login").hidden = true;
    $("#admin-view").hidden = false;
    refresh();
    if (!timer) timer = setInterval(refresh, 5000);
  }

  $("#admin-login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = $("#admin-login input[name=token]");
    sessionStorage.setItem(KEY, input.value);
    input.value = "";
    open();
  });
  $("#admin-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    showLogin("The admin token (kept in this tab only):");
  });
  $("#override-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.target;
    const body = {
      rule: f.rule.value,
      values: f.values.value.trim() === "" ? [] : f.values.value.split("|").map((v) => v.trim()),
      limit: Number(f.limit.value),
    };
    if (f.window.value.trim()) body.window = f.window.value.trim();
    if (f.for.value.trim()) body.for = f.for.value.trim();
    try {
      await api("POST", "override", body);
      f.reset();
      await refresh();
    } catch (e) {
      showError(e);
    }
  });

  if (sessionStorage.getItem(KEY)) open();
  else showLogin();
})();
