// The tokenfeed console: reads the JSON API every few seconds and renders it.
// Rules: every value from the API is set with textContent (never innerHTML), nothing is
// loaded from outside the server, and the token stays in this tab's sessionStorage.
"use strict";

(() => {
  const REFRESH_MS = 2000;
  const HISTORY_S = 300; // the sparkline shows the last five minutes seen by this page
  const TOKEN_KEY = "tokenfeed.token";
  const AGE_HEADER = "X-Tokenfeed-Snapshot-Age";
  const history = new Map(); // job id -> [[seconds, tokens/s], ...]
  let snapshotAge = null; // seconds: how old the data plane's snapshot of the jobs was

  const $ = (id) => document.getElementById(id);

  /** A new element whose text (never HTML) is `text`. */
  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  const int = (n) => Number(n).toLocaleString("en-US");

  function short(n) {
    const units = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (const [size, unit] of units) {
      if (Math.abs(n) >= size) return (n / size).toFixed(n / size >= 100 ? 0 : 1) + unit;
    }
    return String(Math.round(n));
  }

  function duration(s) {
    if (s === null || s === undefined) return "—";
    if (s < 1) return "now";
    if (s < 60) return `${Math.round(s)} s ago`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m} min ago`;
    return `${Math.floor(m / 60)} h ${m % 60} min ago`;
  }

  function uptime(s) {
    const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600);
    const m = Math.floor((s % 3600) / 60);
    return d ? `${d} d ${h} h` : h ? `${h} h ${m} min` : m ? `${m} min` : `${Math.floor(s)} s`;
  }

  class Unauthorized extends Error {}

  async function getJSON(path) {
    const headers = { Accept: "application/json" };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    const res = await fetch(path, { headers, cache: "no-store" });
    if (res.status === 401) throw new Unauthorized(path);
    const age = res.headers.get(AGE_HEADER);
    if (age !== null) snapshotAge = Number(age);
    if (!res.ok) {
      let detail = "";
      try { detail = (await res.json()).detail; } catch (_) { /* not JSON */ }
      throw new Error(`${path}: HTTP ${res.status} ${detail || ""}`.trim());
    }
    return res.json();
  }

  function facts(target, pairs) {
    target.replaceChildren(...pairs.map(([name, value]) => {
      const div = el("div");
      div.dataset.field = name;
      div.append(el("dt", name), el("dd", value));
      return div;
    }));
  }

  function renderServer(status, limits) {
    $("headline").textContent = `tokenfeed-server ${status.version} · ${status.server}`;
    facts($("server"), [
      ["version", status.version],
      ["uptime", uptime(status.uptime_s)],
      ["ready", status.ready ? "yes" : "no"],
      ["connections", status.connections === null ? "(admin only)" : int(status.connections)],
      ["auth", status.config.auth + (status.config.curve ? " + CURVE" : "")],
      ["rate cap", status.config.max_tokens_per_s ? `${short(status.config.max_tokens_per_s)} tokens/s` : "none"],
    ]);
    if (!limits) {
      $("limits").replaceChildren();
      return;
    }
    facts($("limits"), [
      ["max connections", int(limits.max_connections)],
      ["per tenant", int(limits.max_connections_per_tenant)],
      ["max jobs", int(limits.max_jobs)],
      ["max window", int(limits.max_window)],
      ["max batch tokens", int(limits.max_batch_tokens)],
    ]);
  }

  /** An SVG polyline of the rates seen for one job (no HTML: built node by node). */
  function sparkline(points) {
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("class", "spark");
    svg.setAttribute("viewBox", "0 0 100 20");
    svg.setAttribute("preserveAspectRatio", "none");
    if (points.length < 2) return svg;
    const t0 = points[0][0], t1 = points[points.length - 1][0];
    const top = Math.max(...points.map((p) => p[1])) || 1;
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", points.map(([t, v]) =>
      `${(((t - t0) / (t1 - t0 || 1)) * 100).toFixed(1)},${(19 - (v / top) * 18).toFixed(1)}`).join(" "));
    svg.append(line);
    return svg;
  }

  function remember(jobs) {
    const now = Date.now() / 1000;
    const seen = new Set();
    for (const job of jobs) {
      seen.add(job.id);
      const points = history.get(job.id) || [];
      points.push([now, job.consumed_tokens_per_s]);
      while (points.length && now - points[0][0] > HISTORY_S) points.shift();
      history.set(job.id, points);
    }
    for (const id of [...history.keys()]) if (!seen.has(id)) history.delete(id);
  }

  function cell(field, content, className) {
    const td = el("td", typeof content === "object" ? undefined : content, className);
    td.dataset.field = field;
    if (typeof content === "object") td.append(...content);
    return td;
  }

  /** The short form of a content hash: 12 hex digits after its algorithm prefix. */
  const shortHash = (hash) => String(hash).split(":").pop().slice(0, 12);

  /** What a job reads: its dataset, or "mixture" with each source's current weight. */
  function kindCell(job) {
    if (job.kind !== "mixture") return cell("kind", "dataset");
    const weights = job.current_weights || {};
    const total = Object.values(weights).reduce((a, b) => a + b, 0) || 1;
    const text = (job.sources || []).map((name) =>
      `${name} ${((100 * (weights[name] || 0)) / total).toFixed(0)}%`).join(" · ");
    const td = cell("kind", [el("span", "mixture", "badge"), el("span", ` ${text}`, "muted")]);
    td.title = "the weights in effect at the served position";
    return td;
  }

  /**
   * The run id, and the steps it skipped on purpose at a resume (after a loss spike):
   * each [position, samples] range as global steps, the positions in the tooltip.
   */
  function runCell(job) {
    const td = cell("run", job.run || "—", job.run ? undefined : "muted");
    const ranges = job.skipped || [];
    if (ranges.length === 0) return td;
    const step = job.batch_size * job.world_size;
    const steps = ranges.map(([at, n]) => {
      const first = Math.floor(at / step);
      const last = Math.floor((at + n - 1) / step);
      return first === last ? `${first}` : `${first}–${last}`;
    });
    const badge = el("span", `skipped steps ${steps.join(", ")}`, "badge warn");
    badge.dataset.field = "skipped";
    badge.title = "skipped on purpose at a resume (never trained on): positions " +
      ranges.map(([at, n]) => `${int(at)}–${int(at + n - 1)}`).join(", ");
    td.append(" ", badge);
    return td;
  }

  /** When the job's last request came, or when it ended (and whether it is forgotten). */
  function lastCell(job) {
    if (job.ended === null || job.ended === undefined) return cell("idle", duration(job.idle_s));
    const ago = duration(Date.now() / 1000 - job.ended);
    return cell("idle", job.forgotten ? `ended ${ago} · final` : `ended ${ago}`, "muted");
  }

  function renderJobs(jobs) {
    remember(jobs);
    // Live jobs first; the forgotten ones (final counters) after them.
    jobs.sort((a, b) => Number(Boolean(a.forgotten)) - Number(Boolean(b.forgotten)) ||
      a.tenant.localeCompare(b.tenant) || a.dataset.localeCompare(b.dataset));
    const rows = jobs.map((job) => {
      const ended = job.ended !== null && job.ended !== undefined;
      const tr = el("tr", undefined, ended ? "ended" : undefined);
      tr.dataset.job = job.id;
      tr.dataset.forgotten = job.forgotten ? "yes" : "no";
      tr.title = `job ${job.id}` + (job.forgotten ? " (forgotten by the server: final counters)" : "");
      const plan = `seq ${job.seq_len} · batch ${job.batch_size} · world ${job.world_size} · seed ${job.seed}`;
      // Progress is the training loop's (what it consumed), not the server's prefetch;
      // a trainer that has not reported yet shows a dash.
      let progress = [el("span", "—", "muted")];
      if (job.consumed_position !== null) {
        const into = job.consumed_position - job.consumed_epoch * job.epoch_windows;
        const bar = el("progress");
        bar.max = job.epoch_windows;
        bar.value = into;
        const pct = ((100 * into) / job.epoch_windows).toFixed(1);
        progress = [bar, el("span", `epoch ${job.consumed_epoch} · ${pct}%`, "progress-label")];
      }
      const consumed = job.consumed_position === null ? "—" : int(job.consumed_position);
      tr.append(
        cell("tenant", job.tenant),
        cell("dataset", job.dataset),
        kindCell(job),
        runCell(job),
        cell("plan", plan),
        cell("workers", job.workers, "num"),
        cell("consumed", consumed, "num"),
        cell("prefetched", int(job.position), "num"),
        cell("progress", progress),
        cell("rate", [el("span", short(job.consumed_tokens_per_s)), sparkline(history.get(job.id))], "num"),
        cell("retransmits", int(job.retransmits), "num"),
        lastCell(job),
      );
      return tr;
    });
    $("jobs").tBodies[0].replaceChildren(...rows);
    $("jobs-empty").hidden = jobs.length > 0;
    $("jobs-count").textContent = `(${jobs.length})`;
    $("jobs-age").textContent = snapshotAge === null ? "" :
      `as of ${snapshotAge.toFixed(1)} s before this refresh (the server's snapshot, every 0.5 s)`;
  }

  const STATUS_CLASS = { ok: "badge ok", degraded: "badge warn", unavailable: "badge bad" };

  /** The row under a dataset that is not ok: its error, since when, the objects named. */
  function troubleRow(ds, columns) {
    const tr = el("tr", undefined, "trouble");
    tr.dataset.trouble = ds.name;
    const td = cell("trouble", undefined);
    td.colSpan = columns;
    const what = ds.status === "degraded" ? "retrying object storage: " : "not served: ";
    const error = el("div", what + (ds.error || "(no error reported)"), "error-text");
    error.dataset.field = "error";
    td.append(error);
    if (ds.since !== null && ds.since !== undefined) {
      const at = new Date(ds.since * 1000).toLocaleString();
      const since = el("div", `since ${at} (${duration(Date.now() / 1000 - ds.since)})`, "muted");
      since.dataset.field = "since";
      td.append(since);
    }
    if (ds.objects && ds.objects.length) {
      const list = el("ul", undefined, "objects");
      for (const obj of ds.objects) {
        const li = el("li");
        li.dataset.object = obj.url;
        li.dataset.kind = obj.kind;
        li.append(el("span", obj.kind, "kind"), el("code", obj.url));
        list.append(li);
      }
      td.append(list);
    }
    if (ds.fix) {
      const fix = el("div", undefined, "fix");
      fix.dataset.field = "fix";
      fix.append(el("span", "to fix: ", "muted"), el("code", ds.fix));
      td.append(fix);
    }
    tr.append(td);
    return tr;
  }

  /** The tokenizer: its kind label, vocabulary, EOS id and the short form of its hash
   * (equal tokenizers share it, whatever their labels), the full hash as a tooltip. */
  function tokenizerCell(t) {
    const td = cell("tokenizer", `${t.kind} · vocab ${int(t.vocab_size)} · eos ${t.eos_id}`);
    if (t.hash) {
      const hash = el("code", ` #${shortHash(t.hash)}`, "hash");
      hash.dataset.field = "tokenizer-hash";
      hash.title = t.hash;
      td.append(hash);
    }
    return td;
  }

  function renderDatasets(datasets) {
    const columns = 7;
    const rows = datasets.flatMap((ds) => {
      const tr = el("tr");
      tr.dataset.dataset = ds.name;
      const status = ds.status || (ds.ok ? "ok" : "unavailable");
      tr.dataset.status = status;
      const badge = cell("status", [el("span", status, STATUS_CLASS[status] || "badge")]);
      if (ds.tokenizer === undefined) { // not opened: no manifest summary to show
        const none = cell("summary", "—", "muted");
        none.colSpan = columns - 2;
        tr.append(cell("name", ds.name), badge, none);
      } else {
        const t = ds.tokenizer;
        tr.append(
          cell("name", ds.name),
          badge,
          cell("tokens", int(ds.tokens), "num"),
          cell("documents", int(ds.documents), "num"),
          tokenizerCell(t),
          cell("shards", ds.shards, "num"),
          cell("created", ds.created),
        );
      }
      return status === "ok" ? [tr] : [tr, troubleRow(ds, columns)];
    });
    $("datasets").tBodies[0].replaceChildren(...rows);
    $("datasets-count").textContent = `(${datasets.length})`;
  }

  function setLive(ok, text) {
    const badge = $("live");
    badge.className = ok ? "badge ok" : "badge bad";
    badge.textContent = ok ? "live" : "offline";
    $("updated").textContent = text;
  }

  /** Ask for a token. A message (a refused token) stays until the user acts (submits
   * again): the refreshes that keep asking call this without one and leave it shown. */
  function showLogin(message) {
    $("login").hidden = false;
    $("main").hidden = true;
    $("logout").hidden = true;
    if (message !== undefined) $("login-error").textContent = message;
  }

  async function refresh() {
    try {
      const status = await getJSON("v1/status");
      const authenticated = status.config.auth !== "open";
      if (authenticated && !sessionStorage.getItem(TOKEN_KEY)) {
        renderServer(status, null);
        showLogin();
        setLive(true, "waiting for a token");
        return;
      }
      const [limits, datasets, jobs] = await Promise.all([
        getJSON("v1/limits"), getJSON("v1/datasets"), getJSON("v1/jobs?forgotten=true"),
      ]);
      renderServer(status, limits);
      renderJobs(jobs);
      renderDatasets(datasets);
      $("login").hidden = true;
      $("main").hidden = false;
      $("logout").hidden = !authenticated;
      setLive(true, `updated ${new Date().toLocaleTimeString()} · every ${REFRESH_MS / 1000} s`);
    } catch (err) {
      if (err instanceof Unauthorized) {
        sessionStorage.removeItem(TOKEN_KEY);
        showLogin("The server does not accept this token.");
      } else {
        setLive(false, `cannot reach the server: ${err.message}`);
      }
    }
  }

  let timer = null;
  async function loop() {
    clearTimeout(timer);
    await refresh();
    timer = setTimeout(loop, REFRESH_MS);
  }

  function start() {
    $("login").addEventListener("submit", (event) => {
      event.preventDefault();
      $("login-error").textContent = ""; // the user acted: the old verdict goes
      sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
      $("token").value = "";
      loop();
    });
    $("logout").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      history.clear();
      loop();
    });
    loop();
  }

  start();
})();
