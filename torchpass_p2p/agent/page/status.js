// The status page of one torchpass_p2p member: draws each status document that /events pushes
// (torchpass_p2p/agent/sse.py; its schema: torchpass_p2p/cli/status.py).
//
// What must stay true: no data is ever parsed as markup. Every node is made with
// createElement and filled with textContent (or a text node); data goes into attributes only
// through setAttribute on data-* and class names, and into styles only through the CSSOM.
// Member ids, event details and error strings may hold anything a peer or a driver sent.
"use strict";

(function () {
  const PHASES = [
    ["detected", "detected_at"],
    ["decided", "decided_at"],
    ["transferred", "transferred_at"],
    ["rebuilt", "rebuilt_at"],
    ["resumed", "resumed_at"],
  ];
  const EVENTS_SHOWN = 20;
  const STALE_MS = 5000;
  const STATE_CLASSES = new Set(["alive", "suspect", "dead", "left"]);
  const ROLE_ORDER = { rank: 0, spare: 1, joining: 2, removed: 3 };

  let lastUpdate = 0;
  let updates = 0;

  // --- DOM helpers: text only

  function el(tag, className, ...children) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.appendChild(typeof child === "object" ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function text(value) {
    if (value === null || value === undefined) return "\u2014";
    if (typeof value === "object") return JSON.stringify(value);
    return String(value);
  }

  function byId(id) {
    return document.getElementById(id);
  }

  function fill(id, ...children) {
    byId(id).replaceChildren(...children.filter((c) => c !== null && c !== undefined));
  }

  function empty(message) {
    return el("p", "empty", message);
  }

  function seconds(value) {
    return typeof value === "number" && isFinite(value) ? value.toFixed(2) + " s" : "\u2014";
  }

  function ago(doc, at) {
    if (typeof at !== "number") return "\u2014";
    if (typeof doc.clock === "number" && at <= doc.clock + 1) {
      return (doc.clock - at).toFixed(1) + " s ago";
    }
    return at.toFixed(3);
  }

  function bytes(n) {
    if (typeof n !== "number") return "?";
    if (n >= 1 << 30) return (n / (1 << 30)).toFixed(2) + " GiB";
    if (n >= 1 << 20) return (n / (1 << 20)).toFixed(2) + " MiB";
    if (n >= 1 << 10) return (n / (1 << 10)).toFixed(1) + " KiB";
    return n + " B";
  }

  function list(values) {
    return Array.isArray(values) && values.length ? values.map(text).join(", ") : "\u2014";
  }

  // --- sections

  function drawHeader(doc) {
    byId("cluster").textContent = text(doc.cluster);
    const summary = byId("summary");
    const mine = text(doc.role) + (doc.rank === null || doc.rank === undefined ? "" : " " + doc.rank);
    fill("summary",
      "configuration ", el("strong", "", text(doc.config_id)),
      " \u00b7 world size ", el("strong", "", text(doc.world_size)),
      " \u00b7 step ", el("strong", "", text(doc.step)),
      " \u00b7 this member ", el("span", "member", text(doc.member_id)), " (" + mine + ")",
      doc.fenced ? el("span", "badge bad", "FENCED") : null,
      doc.draining ? el("span", "badge warn", "DRAINING") : null,
    );
    summary.setAttribute("data-config-id", text(doc.config_id));
  }

  function memberOrder(a, b) {
    const ra = ROLE_ORDER[a.role] ?? 9, rb = ROLE_ORDER[b.role] ?? 9;
    if (ra !== rb) return ra - rb;
    const ka = typeof a.rank === "number" ? a.rank : -1, kb = typeof b.rank === "number" ? b.rank : -1;
    if (ka !== kb) return ka - kb;
    return String(a.member_id) < String(b.member_id) ? -1 : 1;
  }

  function drawMembers(doc) {
    const members = Array.isArray(doc.members) ? doc.members.slice().sort(memberOrder) : [];
    const rows = members.map((m) => {
      const state = String(m.state);
      const row = el("tr", "role-" + (m.role === "spare" ? "spare" : "rank"),
        el("td", "", m.rank === null || m.rank === undefined ? "\u2014" : text(m.rank)),
        el("td", "member", text(m.member_id)),
        el("td", "role", text(m.role)),
        el("td", STATE_CLASSES.has(state) ? "state-" + state : "", state),
        el("td", "", text(m.incarnation)),
        el("td", "mono", text(m.address)));
      if (m.member_id === doc.member_id) row.classList.add("me");
      row.setAttribute("data-member", text(m.member_id));
      row.setAttribute("data-role", text(m.role));
      row.setAttribute("data-rank", m.rank === null || m.rank === undefined ? "" : text(m.rank));
      row.setAttribute("data-state", state);
      return row;
    });
    byId("members").tBodies[0].replaceChildren(...rows);
    const ranks = members.filter((m) => m.role === "rank").length;
    const spares = members.filter((m) => m.role === "spare").length;
    const unwell = members.filter((m) => m.state !== "alive").length;
    byId("members-summary").textContent =
      `${ranks} rank${ranks === 1 ? "" : "s"}, ${spares} spare${spares === 1 ? "" : "s"}` +
      (unwell ? `, ${unwell} not alive` : ", all alive");
  }

  function describeRecovery(r) {
    const parts = [];
    for (const [rank, member] of Array.isArray(r.assignments) ? r.assignments : []) {
      parts.push(`rank ${text(rank)} \u2192 ${text(member)}`);
    }
    if (Array.isArray(r.vacant) && r.vacant.length) parts.push("vacant " + list(r.vacant));
    return parts.length ? parts.join(", ") : "ranks renumbered";
  }

  function drawRecoveries(doc) {
    const recoveries = Array.isArray(doc.recoveries) ? doc.recoveries.slice().reverse() : [];
    if (!recoveries.length) {
      fill("recoveries", empty("None since this member started."));
      return;
    }
    fill("recoveries", ...recoveries.map((r) => {
      const start = typeof r.detected_at === "number" ? r.detected_at : r.decided_at;
      const times = PHASES.map(([, key]) => r[key]);
      const last = Math.max(...times.filter((t) => typeof t === "number").map((t) => t - start), 0);
      const phases = el("div", "phases", ...PHASES.map(([name, key]) => {
        const t = r[key];
        const seen = typeof t === "number" && typeof start === "number";
        let label = name;
        if (name === "transferred" && seen && r.transferred_by !== "received") {
          label = `transferred (${text(r.transferred_by)})`;
        }
        const phase = el("div", "phase" + (seen ? " seen" : ""),
          el("div", "name", label), el("div", "time", seen ? "+" + seconds(t - start) : "\u2014"));
        phase.setAttribute("data-phase", name);
        return phase;
      }));
      const done = el("div", "done");
      const reached = PHASES.filter(([, key]) => typeof r[key] === "number").length;
      done.style.width = (100 * reached / PHASES.length) + "%";
      const box = el("div", "recovery",
        el("h3", "", `configuration ${text(r.config_id)}: ${describeRecovery(r)}`),
        el("p", "dim",
          `removed ${list(r.removed)} \u00b7 resume at step ${text(r.resume_step)} \u00b7 ` +
          `action ${text(r.action)} \u00b7 ${reached} of ${PHASES.length} phases seen, ` +
          `last at +${seconds(last)}`),
        phases, el("div", "track", done));
      box.setAttribute("data-config-id", text(r.config_id));
      return box;
    }));
  }

  function drawTransfer(doc) {
    const t = doc.transfer;
    if (!t || typeof t !== "object") {
      fill("transfer", empty("No state transfer since this member started."));
      return;
    }
    const total = typeof t.total_bytes === "number" ? t.total_bytes : null;
    const done = typeof t.done_bytes === "number" ? t.done_bytes : 0;
    const bar = el("progress", "");
    if (total) {
      bar.max = total;
      bar.value = Math.min(done, total);
    }
    const end = typeof t.finished_at === "number" ? t.finished_at : t.updated_at;
    // A source hears of its first chunk only once it is sent: a transfer of one chunk has
    // no duration to show.
    const spent = typeof end === "number" && typeof t.started_at === "number" &&
      end > t.started_at ? end - t.started_at : null;
    const rate = spent ? bytes(done / spent) + "/s" : null;
    const what = t.direction === "sending"
      ? "sending this member's state" + (t.finished_at ? "" : " (its share, when several sources serve one fetch)")
      : "receiving the state" + (typeof t.sources === "number" ? ` from ${t.sources} source${t.sources === 1 ? "" : "s"}` : "");
    const box = el("div", "",
      el("p", "", `${what} after ${text(t.step)} steps` +
        (t.config_id === null || t.config_id === undefined ? "" : ` for configuration ${t.config_id}`)),
      bar,
      el("p", "", `${bytes(done)} of ${total === null ? "?" : bytes(total)}` +
        (total ? ` (${Math.floor(100 * done / total)} %)` : "") +
        (spent === null ? "" : ` in ${seconds(spent)}`) + (rate ? `, ${rate}` : "") +
        (t.finished_at ? ", done" : ", in progress")));
    box.setAttribute("data-direction", text(t.direction));
    fill("transfer", box);
  }

  function drawConfigurations(doc) {
    const configs = Array.isArray(doc.configurations) ? doc.configurations.slice().reverse() : [];
    const rows = configs.map((c) => {
      const ranks = Array.isArray(c.ranks)
        ? c.ranks.map((m, i) => el("div", "", `${i}: ${text(m)}`)) : ["\u2014"];
      const row = el("tr", "",
        el("td", "", text(c.config_id)),
        el("td", "", ago(doc, c.decided_at)),
        el("td", "", c.round === 0 ? "fast" : "classic " + text(c.round)),
        el("td", "member", ...ranks),
        el("td", "member", list(c.spares)),
        el("td", "member", list(c.removed)),
        el("td", "member", list(c.joined)),
        el("td", "", text(c.resume_step)),
        el("td", "", text(c.action)));
      row.setAttribute("data-config-id", text(c.config_id));
      return row;
    });
    if (!rows.length) {
      const cell = el("td", "empty", `No change decided yet: configuration ${text(doc.config_id)} is the one this member started in.`);
      cell.colSpan = 9;
      rows.push(el("tr", "", cell));
    }
    byId("configurations").tBodies[0].replaceChildren(...rows);
  }

  function drawStragglers(doc) {
    const found = doc.stragglers;
    if (!Array.isArray(found)) {
      fill("stragglers", empty("This agent reports no straggler data. When it does, a rank " +
        "whose arrival at the gradient collective lags the first rank's, step after step, is " +
        "named here with its member id and lag."));
      return;
    }
    if (!found.length) {
      fill("stragglers", empty("None named: no rank lags the others."));
      return;
    }
    const keys = ["rank", "member_id"].filter((k) => found.some((s) => s && typeof s === "object" && k in s));
    for (const s of found) {
      for (const k of Object.keys(s && typeof s === "object" ? s : {})) if (!keys.includes(k)) keys.push(k);
    }
    fill("stragglers", el("table", "",
      el("thead", "", el("tr", "", ...keys.map((k) => el("th", "", k)))),
      el("tbody", "", ...found.map((s) => el("tr", "", ...keys.map((k) => el("td", "", text(s[k]))))))));
  }

  function pairs(object) {
    const dl = el("dl", "pairs");
    for (const [key, value] of Object.entries(object)) {
      dl.appendChild(el("dt", "", key));
      dl.appendChild(el("dd", "", text(value)));
    }
    return dl;
  }

  function drawHealth(doc) {
    const health = doc.health && typeof doc.health === "object" ? doc.health : {};
    const shown = {};
    for (const [k, v] of Object.entries(health)) {
      if (v === null || (Array.isArray(v) && !v.length) ||
          (typeof v === "object" && !Array.isArray(v) && !Object.keys(v).length)) continue;
      shown[k] = v;
    }
    const pulse = doc.pulse && typeof doc.pulse === "object" ? doc.pulse : null;
    const drops = {};
    for (const [k, v] of Object.entries(doc.counters || {})) {
      if (k.startsWith("rejected") && v) drops[k] = v;
    }
    fill("health",
      el("p", "dim", "GPU health monitor"), pairs(shown),
      pulse ? el("p", "dim", "pulse") : null,
      pulse ? pairs({ responder_port: pulse.responder_port, watching: pulse.watching,
        silent: list(pulse.silent) }) : null,
      el("p", "dim", "inputs dropped"),
      Object.keys(drops).length ? pairs(drops) : empty("none"));
  }

  function drawEvents(doc) {
    const events = Array.isArray(doc.recent_events) ? doc.recent_events.slice(-EVENTS_SHOWN).reverse() : [];
    const items = events.map((e) => el("li", "",
      el("span", "dim", ago(doc, e.at)), el("span", "type", text(e.type)), el("span", "mono", text(e.detail))));
    byId("events").replaceChildren(...(items.length ? items : [el("li", "empty", "none")]));
  }

  function draw(doc) {
    const error = byId("error");
    try {
      drawHeader(doc);
      drawMembers(doc);
      drawRecoveries(doc);
      drawTransfer(doc);
      drawConfigurations(doc);
      drawStragglers(doc);
      drawHealth(doc);
      drawEvents(doc);
      error.hidden = true;
    } catch (exc) {
      error.textContent = "could not draw this status document: " + String(exc);
      error.hidden = false;
    }
    updates += 1;
    document.body.setAttribute("data-updates", String(updates));
  }

  // --- the stream

  function setConnection(state, message) {
    const node = byId("connection");
    node.className = "connection " + state;
    node.textContent = message;
  }

  function connect() {
    const source = new EventSource("/events");
    source.addEventListener("status", (event) => {
      let doc;
      try {
        doc = JSON.parse(event.data);
      } catch (exc) {
        setConnection("stale", "received a malformed document");
        return;
      }
      lastUpdate = Date.now();
      setConnection("live", "live: updated " + new Date(lastUpdate).toLocaleTimeString());
      draw(doc);
    });
    source.onerror = () => {
      setConnection("connecting", "connection lost: reconnecting\u2026");
    };
    setInterval(() => {
      if (lastUpdate && Date.now() - lastUpdate > STALE_MS && source.readyState === EventSource.OPEN) {
        setConnection("stale", "no change for " + Math.round((Date.now() - lastUpdate) / 1000) + " s");
      }
    }, 1000);
  }

  connect();
})();
