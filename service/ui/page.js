// loadmaster's page: the plan in force, live figures, what-if planning and a playground.
// Plain JS, no libraries; every picture comes from the server's one renderer (POST /ui/picture).
"use strict";
(function () {
  const boot = JSON.parse(document.getElementById("boot").textContent);
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "loadmaster-api-key";
  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

  function bytes(n) {
    if (n === null || n === undefined || isNaN(n)) return "–";
    let v = Number(n), i = 0;
    while (Math.abs(v) >= 1024 && i < UNITS.length - 1) { v /= 1024; i += 1; }
    return (i === 0 ? String(v) : v.toFixed(v >= 100 ? 0 : v >= 10 ? 1 : 2)) + " " + UNITS[i];
  }
  function deviceName(d) { return typeof d === "number" ? "GPU " + d : String(d); }
  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }

  // -- API key: asked once (before the first call when the server needs one), sent as a bearer token ------------
  let pendingKey = null;
  function askKey() {
    if (pendingKey) return pendingKey;
    const dialog = $("key-dialog");
    pendingKey = new Promise((resolve) => {
      $("key-form").addEventListener("submit", function onSubmit(ev) {
        ev.preventDefault();
        const key = $("key-input").value.trim();
        if (!key) return;
        sessionStorage.setItem(KEY_STORE, key);
        $("key-form").removeEventListener("submit", onSubmit);
        dialog.close();
        pendingKey = null;
        resolve(key);
      });
    });
    dialog.showModal();
    $("key-input").focus();
    return pendingKey;
  }
  async function api(path, options) {
    for (let attempt = 0; attempt < 3; attempt += 1) {
      if (boot.needs_key && !sessionStorage.getItem(KEY_STORE)) await askKey();
      const opts = Object.assign({}, options || {});
      const headers = Object.assign({}, opts.headers || {});
      const key = sessionStorage.getItem(KEY_STORE);
      if (key) headers["Authorization"] = "Bearer " + key;
      opts.headers = headers;
      const resp = await fetch(path, opts);
      if (resp.status !== 401) return resp;
      sessionStorage.removeItem(KEY_STORE);
      boot.needs_key = true;
      $("key-button").hidden = false;
    }
    throw new Error("the API key was refused three times");
  }
  async function errorText(resp) {
    try {
      const body = await resp.json();
      const e = body.error;
      return typeof e === "string" ? e : (e && e.message) || JSON.stringify(body);
    } catch (_) { return resp.status + " " + resp.statusText; }
  }

  // -- the plan picture and its text ---------------------------------------------------------------------------
  async function picture(plan) {
    const resp = await api("/ui/picture", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(plan),
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    return resp.text();
  }
  function rate(x) { return x >= 100 ? Math.round(x).toLocaleString("en") : x.toPrecision(3); }
  function predictionLine(plan) {
    const p = plan.prediction, w = plan.workload;
    return "Predicted load " + p.load_seconds.toFixed(1) + " s, decode " + rate(p.decode_tokens_per_s) +
      " tokens/s (batch " + w.batch_size + ", context " + w.context + ")";
  }
  function showPlan(plan, svg) {
    $("plan-picture").innerHTML = svg;
    $("plan-prediction").textContent = predictionLine(plan);
    const body = $("budget-table").querySelector("tbody");
    body.replaceChildren();
    for (const b of plan.budgets) {
      const row = el("tr");
      const name = el("td");
      const sw = el("span", undefined, "swatch");
      const rect = $("plan-picture").querySelector('.device-bar[data-device="' + String(b.device) + '"] rect');
      if (rect) sw.style.background = rect.getAttribute("fill");
      name.append(sw, deviceName(b.device));
      row.append(name);
      for (const k of ["weights", "kv_cache", "activations", "reserve", "total", "capacity"]) row.append(el("td", bytes(b[k])));
      row.append(el("td", String(b.blocks.length)));
      body.append(row);
    }
    const reasons = $("reasons"), warnings = $("warnings");
    reasons.replaceChildren(...plan.reasons.map((r) => el("li", r)));
    warnings.replaceChildren(...(plan.warnings.length ? plan.warnings.map((w) => el("li", w)) : [el("li", "none")]));
  }
  async function loadPlanInForce() {
    const resp = await api("/info");
    if (!resp.ok) { $("model-line").textContent = "server answered " + resp.status; return false; }
    const info = await resp.json();
    const st = info.status || {};
    $("model-line").textContent = info.model_id
      ? info.model_id + " (" + info.architecture + ", " + info.dtype + (info.quantization ? ", " + info.quantization : "") + ") · v" + info.version
      : "model loading: " + (st.status || "…");
    // the what-if form suggests the context the server plans for: the model's positions cap it, as in /info and /plan
    const context = info.plan ? info.plan.workload.context : (info.limits || {}).max_total_tokens;
    if (context) $("wi-context").placeholder = String(context);
    if (!info.plan) return false;
    showPlan(info.plan, await picture(info.plan));
    return true;
  }

  // -- live figures from /metrics ---------------------------------------------------------------------------------
  function parseMetrics(text) {
    const out = [];
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = line.match(/^([a-zA-Z_:][\w:]*)(\{([^}]*)\})?\s+(\S+)$/);
      if (!m) continue;
      const labels = {};
      if (m[3]) for (const part of m[3].match(/\w+="(?:[^"\\]|\\.)*"/g) || []) {
        const i = part.indexOf("=");
        labels[part.slice(0, i)] = part.slice(i + 2, -1);
      }
      out.push({ name: m[1], labels: labels, value: Number(m[4]) });
    }
    return out;
  }
  function metric(samples, name) {
    const s = samples.find((x) => x.name === name);
    return s ? s.value : null;
  }
  async function pollLive() {
    let resp;
    try { resp = await api("/metrics"); } catch (e) { $("live-updated").textContent = "server unreachable"; return; }
    if (!resp.ok) { $("live-updated").textContent = "metrics: " + resp.status; return; }
    const samples = parseMetrics(await resp.text());
    const tps = metric(samples, "loadmaster_generated_tokens_per_second");
    $("live-tps").textContent = tps === null ? "–" : tps.toFixed(1);
    $("live-batch").textContent = String(metric(samples, "loadmaster_batch_size"));
    $("live-queue").textContent = String(metric(samples, "loadmaster_queue_length"));
    $("live-inflight").textContent = String(metric(samples, "loadmaster_requests_in_flight"));
    $("live-generated").textContent = String(metric(samples, "loadmaster_generated_tokens_total"));
    const n = metric(samples, "loadmaster_time_to_first_token_seconds_count");
    const sum = metric(samples, "loadmaster_time_to_first_token_seconds_sum");
    $("live-ttft").textContent = n ? (1000 * sum / n).toFixed(0) + " ms" : "–";
    const mem = {};
    for (const s of samples) {
      if (s.name !== "loadmaster_memory_bytes") continue;
      (mem[s.labels.device] = mem[s.labels.device] || {})[s.labels.kind] = s.value;
    }
    const body = $("memory-table").querySelector("tbody");
    body.replaceChildren();
    for (const dev of Object.keys(mem)) {
      const m = mem[dev], row = el("tr");
      row.append(el("td", /^\d+$/.test(dev) ? "GPU " + dev : dev), el("td", bytes(m.planned)), el("td", bytes(m.measured)));
      const ratio = m.planned ? m.measured / m.planned : null;
      const cell = el("td", ratio === null ? "–" : (100 * ratio).toFixed(0) + "%");
      if (ratio !== null) {
        const meter = el("span", undefined, "meter"), fill = el("span");
        fill.style.width = Math.min(100, 100 * ratio).toFixed(0) + "%";
        meter.setAttribute("aria-hidden", "true");
        meter.append(fill);
        cell.append(meter);
      }
      row.append(cell);
      body.append(row);
    }
    $("live-updated").textContent = "updated " + new Date().toLocaleTimeString();
  }

  // -- what-if: POST /plan with declared hardware ------------------------------------------------------------------
  async function whatIf(ev) {
    ev.preventDefault();
    const result = $("whatif-result"), button = $("wi-submit");
    const body = { batch_size: Number($("wi-batch").value || 1) };
    const gpus = $("wi-gpus").value.trim(), cpu = $("wi-cpu").value.trim(), disk = $("wi-disk").value.trim();
    if (gpus) body.gpus = gpus;
    const maxMemory = {};
    if (cpu) maxMemory.cpu = cpu;
    if (disk) maxMemory.disk = disk;
    if (Object.keys(maxMemory).length) body.max_memory = maxMemory;
    if ($("wi-dtype").value) body.dtype = $("wi-dtype").value;
    if ($("wi-quant").value) body.quantization = $("wi-quant").value;
    if ($("wi-context").value) body.context = Number($("wi-context").value);
    button.disabled = true;
    result.replaceChildren(el("p", "planning…"));
    try {
      const resp = await api("/plan", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
      if (!resp.ok) {
        const msg = await errorText(resp);
        $("whatif-picture").replaceChildren();
        result.replaceChildren(el("p", "Does not fit:", "error"), el("p", msg, "error advice"));
        result.dataset.state = "no-fit";
        return;
      }
      const plan = await resp.json();
      $("whatif-picture").innerHTML = await picture(plan);
      result.replaceChildren(el("p", predictionLine(plan), "prediction"));
      if (plan.warnings.length) {
        const list = el("ul");
        list.append(...plan.warnings.map((w) => el("li", w)));
        result.append(list);
      }
      result.dataset.state = "plan";
    } catch (e) {
      result.replaceChildren(el("p", String(e.message || e), "error"));
      result.dataset.state = "error";
    } finally {
      button.disabled = false;
    }
  }

  // -- playground: POST /generate_stream, tokens as they arrive ----------------------------------------------------
  async function play(ev) {
    ev.preventDefault();
    const out = $("play-output"), stats = $("play-stats"), button = $("play-submit");
    const params = { max_new_tokens: Number($("play-max").value || 32), details: false };
    if ($("play-sample").checked) {
      params.do_sample = true;
      params.temperature = Number($("play-temp").value);
      params.top_p = Number($("play-topp").value);
    }
    if ($("play-seed").value !== "") params.seed = Number($("play-seed").value);
    out.textContent = "";
    out.dataset.tokens = "0";
    button.disabled = true;
    stats.textContent = "generating…";
    const started = performance.now();
    let first = null, count = 0;
    try {
      const resp = await api("/generate_stream", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ inputs: $("play-prompt").value, parameters: params }),
      });
      if (!resp.ok) { stats.textContent = await errorText(resp); stats.className = "error"; return; }
      const reader = resp.body.getReader(), decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = JSON.parse(line.slice(5));
            if (data.error) { stats.textContent = data.error; stats.className = "error"; return; }
            if (data.token) {
              if (first === null) first = performance.now();
              count += 1;
              out.textContent += data.token.text;
              out.dataset.tokens = String(count);
            }
          }
        }
      }
      const secs = (performance.now() - started) / 1000;
      stats.className = "muted";
      stats.textContent = count + " tokens in " + secs.toFixed(2) + " s; first after " +
        (first === null ? "–" : ((first - started) / 1000).toFixed(2) + " s");
    } catch (e) {
      stats.textContent = String(e.message || e);
      stats.className = "error";
    } finally {
      button.disabled = false;
    }
  }

  // -- start ---------------------------------------------------------------------------------------------------
  async function start() {
    if (boot.offline) {
      $("offline-note").hidden = false;
      for (const id of ["live", "whatif", "playground"]) $(id).hidden = true;
      $("model-line").textContent = boot.plan.model + " (" + boot.plan.architecture + "), offline copy";
      showPlan(boot.plan, boot.svg);
      return;
    }
    $("key-button").hidden = !boot.needs_key;
    $("key-button").addEventListener("click", () => { sessionStorage.removeItem(KEY_STORE); askKey(); });
    $("whatif-form").addEventListener("submit", whatIf);
    $("play-form").addEventListener("submit", play);
    const tryPlan = async () => {
      let ok = false;
      try { ok = await loadPlanInForce(); } catch (e) { $("model-line").textContent = String(e.message || e); }
      if (!ok) setTimeout(tryPlan, 2000);
    };
    await tryPlan();
    const tick = async () => { try { await pollLive(); } finally { setTimeout(tick, 1000); } };
    tick();
  }
  start();
})();
