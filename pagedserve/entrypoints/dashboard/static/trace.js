/* pagedserve trace charts: plain JS + SVG, no dependencies, no network.
 *
 * PagedTrace.render(data, root) draws the whole report from the trace JSON (the shape
 * pagedserve.engine.trace.engine_trace_data returns). It can be called again with fresh data (the live
 * dashboard does, every second): the root is redrawn and the selected step is kept, or follows the
 * newest step when the newest was selected. On the first render data.selected_step (if any) is shown.
 * With speculative decoding (data.config.speculative_config, or draft tokens in the steps) the summary,
 * the token bars, the timeline, the block map and a panel of their own show the drafts and what was
 * accepted; without it nothing about speculation is drawn.
 */
(function (global) {
  "use strict";

  var SVGNS = "http://www.w3.org/2000/svg";
  var W = 1200, ML = 70, MR = 70;
  var STATES = {
    waiting: ["var(--wait-fill)", "waiting"],
    prefill: ["var(--prefill)", "prefill chunk"],
    decode: ["var(--decode)", "decoding"],
    stalled: ["var(--stalled)", "running, not scheduled (budget)"],
    preempted: ["var(--preempted)", "preempted"]
  };
  var PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6",
    "#9d755d", "#bab0ac", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#bcbd22"];

  function svg(tag, attrs, parent, text) {
    var e = document.createElementNS(SVGNS, tag);
    for (var k in attrs) if (attrs[k] !== undefined && attrs[k] !== null) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function html(tag, attrs, parent, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) if (attrs[k] !== undefined && attrs[k] !== null) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function tip(node, text) { svg("title", {}, node, text); return node; }
  function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }
  function pct(a, b) { return b ? Math.round((1000 * a) / b) / 10 + "%" : "–"; }
  /* Speculation in one step: "drafts N, accepted M" (empty when the step scored no draft token). */
  function specText(s, rid) {
    if (rid !== undefined) {
      var d = (s.spec_drafts || {})[rid];
      return d && d.length ? "drafts " + d.length + ", accepted " + num((s.spec_accepted || {})[rid]) : "";
    }
    return num(s.num_spec_tokens) ?
      "drafts " + num(s.num_spec_tokens) + ", accepted " + num(s.num_accepted_tokens) : "";
  }
  function num(v) { return typeof v === "number" && isFinite(v) ? v : 0; }
  function niceMax(v) {
    if (v <= 4) return 4;  // small counts: whole-number ticks
    if (v <= 8) return 8;
    var p = Math.pow(10, Math.floor(Math.log10(v))), m = v / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }

  function panel(root, id, title, note, legend) {
    var box = html("section", { "class": "pt-panel", id: id + "-panel" }, root);
    html("h2", {}, box, title);
    if (note) html("p", { "class": "pt-note" }, box, note);
    if (legend) {
      var lg = html("div", { "class": "pt-legend" }, box);
      legend.forEach(function (l) { html("span", { style: "--sw:" + l[0] }, lg, l[1]); });
    }
    return box;
  }

  /* A chart frame shared by the per-step charts: same x scale, a cursor at the selected step, and a
   * transparent column per step that selects it on click. */
  function frame(ctx, box, id, height, yMax, yLabel) {
    var n = Math.max(ctx.steps.length, 1), top = 8, bottom = 22;
    var s = svg("svg", { id: id, "class": "pt-chart", viewBox: "0 0 " + W + " " + height, role: "img" }, box);
    var f = {
      svg: s, h: height, top: top, plotH: height - top - bottom, band: (W - ML - MR) / n,
      x: function (i) { return ML + i * f.band; },
      y: function (v) { return top + f.plotH - (v / yMax) * f.plotH; }
    };
    var grid = svg("g", { "class": "pt-grid" }, s);
    for (var k = 0; k <= 4; k++) {
      var v = (yMax * k) / 4, yy = f.y(v);
      svg("line", { x1: ML, x2: W - MR, y1: yy, y2: yy }, grid);
      svg("text", { x: ML - 6, y: yy + 3, "text-anchor": "end" }, grid, String(Math.round(v * 10) / 10));
    }
    svg("text", { x: 4, y: top + 10 }, s, yLabel);
    xAxis(ctx, f);
    f.layer = svg("g", {}, s);
    return f;
  }

  function xAxis(ctx, f) {
    var n = ctx.steps.length, every = Math.max(1, Math.ceil(n / 20)), yb = f.top + f.plotH;
    svg("line", { "class": "pt-axis", x1: ML, x2: W - MR, y1: yb, y2: yb }, f.svg);
    for (var i = 0; i < n; i += every) {
      svg("text", { x: f.x(i) + f.band / 2, y: yb + 14, "text-anchor": "middle" }, f.svg, String(ctx.steps[i].step));
    }
    svg("text", { x: W - MR + 6, y: yb + 14 }, f.svg, "step");
  }

  function finishFrame(ctx, f, describe) {
    var hits = svg("g", {}, f.svg);
    ctx.steps.forEach(function (st, i) {
      var r = svg("rect", { "class": "pt-hit", x: f.x(i), y: f.top, width: f.band, height: f.plotH,
        "data-step": st.step }, hits);
      tip(r, describe(st));
      r.addEventListener("click", function () { ctx.select(i); });
    });
    var c = svg("line", { "class": "pt-cursor", y1: f.top, y2: f.top + f.plotH }, f.svg);
    ctx.cursors.push({ line: c, frame: f });
  }

  // ---- charts ------------------------------------------------------------------------------------
  function tokenChart(ctx, root) {
    var legend = [["var(--prefill)", "prefill tokens"], ["var(--decode)", "decode tokens"]];
    if (ctx.spec) {
      legend.push(["var(--draft-ok)", "draft tokens accepted"], ["var(--draft-no)", "draft tokens rejected"]);
    }
    var box = panel(root, "tokens", "Tokens per step",
      "Prefill and decode tokens computed each step, stacked, against the token budget (max_num_batched_tokens)." +
      (ctx.spec ? " Decode includes the draft tokens the model scored: those accepted and those rejected." : ""),
      legend.concat([["var(--budget)", "token budget"]]));
    var yMax = niceMax(Math.max.apply(null, [1].concat(ctx.steps.map(function (s) {
      return Math.max(num(s.token_budget), num(s.num_prefill_tokens) + num(s.num_decode_tokens));
    }))));
    var f = frame(ctx, box, "chart-tokens", 230, yMax, "tokens");
    var bw = Math.max(1, f.band * 0.8), pad = (f.band - bw) / 2, budget = [];
    ctx.steps.forEach(function (s, i) {
      var p = num(s.num_prefill_tokens), d = num(s.num_decode_tokens), x = f.x(i) + pad;
      var sp = Math.min(num(s.num_spec_tokens), d), ok = Math.min(num(s.num_accepted_tokens), sp), real = d - sp;
      if (p) svg("rect", { "class": "pt-bar-prefill", x: x, y: f.y(p), width: bw, height: f.y(0) - f.y(p),
        fill: "var(--prefill)" }, f.layer);
      if (real) svg("rect", { "class": "pt-bar-decode", x: x, y: f.y(p + real), width: bw,
        height: f.y(p) - f.y(p + real), fill: "var(--decode)" }, f.layer);
      var b = p + real;
      [[ok, "pt-bar-draft-accepted", "var(--draft-ok)"], [sp - ok, "pt-bar-draft-rejected", "var(--draft-no)"]]
        .forEach(function (part) {
          if (!part[0]) return;
          svg("rect", { "class": part[1], x: x, y: f.y(b + part[0]), width: bw, height: f.y(b) - f.y(b + part[0]),
            fill: part[2] }, f.layer);
          b += part[0];
        });
      budget.push(f.x(i) + "," + f.y(num(s.token_budget)), f.x(i + 1) + "," + f.y(num(s.token_budget)));
    });
    if (budget.length) svg("polyline", { id: "budget-line", points: budget.join(" "), fill: "none",
      stroke: "var(--budget)", "stroke-width": 1.5, "stroke-dasharray": "6 3" }, f.layer);
    finishFrame(ctx, f, function (s) {
      return "step " + s.step + ": " + num(s.num_prefill_tokens) + " prefill + " + num(s.num_decode_tokens) +
        " decode tokens of a " + num(s.token_budget) + "-token budget (" + Object.keys(s.scheduled || {}).length +
        " requests, " + (num(s.duration_s) * 1000).toFixed(1) + " ms)" + (specText(s) ? "; " + specText(s) : "");
    });
  }

  function queueChart(ctx, root) {
    var box = panel(root, "queue", "Running, waiting and preemptions",
      "Requests running and waiting after each step; a red mark is a preemption (blocks freed, recomputed later).",
      [["var(--running)", "running"], ["var(--waiting)", "waiting"], ["var(--preempted)", "preemption"]]);
    var yMax = niceMax(Math.max.apply(null, [1].concat(ctx.steps.map(function (s) {
      return Math.max(num(s.num_running), num(s.num_waiting));
    }))));
    var f = frame(ctx, box, "chart-queue", 170, yMax, "requests");
    ["num_running", "num_waiting"].forEach(function (key, k) {
      var pts = ctx.steps.map(function (s, i) { return (f.x(i) + f.band / 2) + "," + f.y(num(s[key])); });
      if (pts.length) svg("polyline", { id: "line-" + key, points: pts.join(" "), fill: "none",
        stroke: k ? "var(--waiting)" : "var(--running)", "stroke-width": 2 }, f.layer);
    });
    ctx.steps.forEach(function (s, i) {
      var np = (s.preempted || []).length;
      if (!np) return;
      var cx = f.x(i) + f.band / 2, y0 = f.top + 2;
      tip(svg("path", { "class": "pt-preemption", d: "M" + (cx - 5) + "," + y0 + " L" + (cx + 5) + "," + y0 +
        " L" + cx + "," + (y0 + 8) + " Z", fill: "var(--preempted)" }, f.layer),
        "step " + s.step + ": preempted " + s.preempted.join(", "));
      if (np > 1) svg("text", { x: cx + 7, y: y0 + 8 }, f.layer, "×" + np);
    });
    finishFrame(ctx, f, function (s) {
      return "step " + s.step + ": " + num(s.num_running) + " running, " + num(s.num_waiting) + " waiting" +
        ((s.preempted || []).length ? ", preempted " + s.preempted.join(", ") : "");
    });
  }

  function kvChart(ctx, root) {
    var box = panel(root, "kv", "KV cache blocks",
      "Blocks held by requests (used), freed but still holding cached prefixes (cached-free), and empty (free).",
      [["var(--used)", "used"], ["var(--cached)", "cached-free"], ["var(--free)", "free"]]);
    var total = num(ctx.config.num_blocks) || Math.max.apply(null, [1].concat(ctx.steps.map(function (s) {
      return num(s.num_used_blocks) + num(s.num_cached_free_blocks) + num(s.num_free_blocks);
    })));
    var f = frame(ctx, box, "chart-kv", 200, total, "blocks");
    var layers = [["num_used_blocks", "var(--used)"], ["num_cached_free_blocks", "var(--cached)"],
      ["num_free_blocks", "var(--free)"]];
    var base = ctx.steps.map(function () { return 0; });
    layers.forEach(function (layer) {
      var topPts = [], botPts = [];
      ctx.steps.forEach(function (s, i) {
        var b = base[i], t = b + num(s[layer[0]]);
        topPts.push(f.x(i) + "," + f.y(t), f.x(i + 1) + "," + f.y(t));
        botPts.unshift(f.x(i + 1) + "," + f.y(b), f.x(i) + "," + f.y(b));
        base[i] = t;
      });
      if (topPts.length) svg("polygon", { id: "area-" + layer[0], points: topPts.concat(botPts).join(" "),
        fill: layer[1], "fill-opacity": 0.85 }, f.layer);
    });
    finishFrame(ctx, f, function (s) {
      return "step " + s.step + ": " + num(s.num_used_blocks) + " used, " + num(s.num_cached_free_blocks) +
        " cached-free, " + num(s.num_free_blocks) + " free; +" + num(s.blocks_allocated) + " allocated, " +
        num(s.blocks_freed) + " freed, " + num(s.blocks_evicted) + " evicted";
    });
  }

  function timeline(ctx, root) {
    var box = panel(root, "timeline", "Requests over time",
      "One row per request from its arrival: waiting, each prefill chunk, decoding, preemptions and how it finished.",
      Object.keys(STATES).map(function (k) { return STATES[k]; }));
    var reqs = ctx.requests, rowH = 16, top = 8, bottom = 22;
    var height = top + bottom + Math.max(1, reqs.length) * rowH;
    var f = { top: top, plotH: reqs.length * rowH, band: (W - ML - MR) / Math.max(ctx.steps.length, 1) };
    f.x = function (i) { return ML + i * f.band; };
    f.svg = svg("svg", { id: "chart-timeline", "class": "pt-chart", viewBox: "0 0 " + W + " " + height }, box);
    xAxis(ctx, f);
    var g = svg("g", {}, f.svg), first = ctx.first;
    reqs.forEach(function (r, k) {
      var y = top + k * rowH;
      var label = svg("text", { "class": "pt-label", x: ML - 6, y: y + 11, "text-anchor": "end" }, g, r.id);
      tip(label, r.id + ": " + (r.prompt_tokens == null ? "?" : r.prompt_tokens) + " prompt tokens, " +
        (r.output_tokens == null ? "?" : r.output_tokens) + " generated" +
        (num(r.draft_tokens) ? "; drafts " + r.draft_tokens + ", accepted " + num(r.accepted_tokens) : "") +
        (r.prompt ? "\n" + r.prompt : ""));
      var row = svg("g", { "class": "pt-request", "data-request": r.id }, g);
      (r.segments || []).forEach(function (seg) {
        var st = STATES[seg.state] || ["#999", seg.state];
        var x0 = f.x(Math.max(0, seg.from - first)), x1 = f.x(seg.to - first + 1);
        if (x1 <= ML) return;
        tip(svg("rect", { "class": "pt-seg pt-seg-" + seg.state, x: x0, y: y + 2, width: Math.max(1, x1 - x0 - 0.5),
          height: rowH - 4, fill: st[0], stroke: seg.state === "prefill" ? "#fff" : "none", "stroke-width": 0.7 }, row),
          r.id + ": " + st[1] + (seg.from === seg.to ? " at step " + seg.from : " steps " + seg.from + "–" + seg.to) +
          (seg.tokens ? ", " + seg.tokens + " tokens" : "") +
          (num(seg.draft_tokens) ?
            " (drafts " + seg.draft_tokens + ", accepted " + num(seg.accepted_tokens) + ")" : ""));
      });
      if (r.finish_step != null) {
        var end = r.finish_reason === "abort" ? r.finish_step - first : r.finish_step - first + 1;
        var fx = f.x(Math.max(0, end));
        var mark = svg("text", { "class": "pt-finish pt-label", x: fx + 3, y: y + 11 }, row,
          (r.finish_reason === "abort" ? "✕ " : "✓ ") + (r.finish_reason || "finished"));
        tip(mark, r.id + " finished at step " + r.finish_step + ": " + r.finish_reason +
          (r.num_preemptions ? " (preempted " + r.num_preemptions + "×, " + r.recomputed_tokens +
            " tokens recomputed)" : ""));
      }
    });
    var c = svg("line", { "class": "pt-cursor", y1: top, y2: top + f.plotH }, f.svg);
    ctx.cursors.push({ line: c, frame: f });
  }

  // ---- the block-table map -------------------------------------------------------------------------
  function ranges(blocks, tokens, bs) {
    return blocks.map(function (b, j) {
      var s = j * bs, e = (j + 1) * bs - 1;
      if (tokens != null) {
        if (tokens <= s) return "(not yet filled) → block " + b;
        e = Math.min(e, tokens - 1);
      }
      return s + "–" + e + " → block " + b;
    });
  }

  function blockMap(ctx, root) {
    var box = panel(root, "blockmap", "Block tables",
      "Which physical KV blocks each request used in the selected step (logical token range → physical block). " +
      "Requests that finished in that step free their blocks at its end.");
    var ctl = html("div", { "class": "pt-controls" }, box);
    var prev = html("button", { type: "button", id: "step-prev" }, ctl, "◀");
    var slider = html("input", { type: "range", id: "step-slider", min: 0, max: Math.max(0, ctx.steps.length - 1),
      step: 1, value: ctx.selIndex }, ctl);
    var next = html("button", { type: "button", id: "step-next" }, ctl, "▶");
    var label = html("span", { id: "step-label" }, ctl);
    slider.addEventListener("input", function () { ctx.select(parseInt(slider.value, 10)); });
    prev.addEventListener("click", function () { ctx.select(Math.max(0, ctx.selIndex - 1)); });
    next.addEventListener("click", function () { ctx.select(Math.min(ctx.steps.length - 1, ctx.selIndex + 1)); });
    var body = html("div", { "class": "pt-blockmap", id: "block-map" }, box);
    ctx.blockMap = { slider: slider, label: label, body: body };
  }

  function drawBlockMap(ctx) {
    var bm = ctx.blockMap, i = ctx.selIndex, st = ctx.steps[i];
    bm.slider.value = i;
    bm.body.textContent = "";
    if (!st) { bm.label.textContent = "no steps yet"; return; }
    var held = (ctx.data.block_tables || [])[i] || {}, bs = num(ctx.config.block_size) || 16;
    var nb = num(ctx.config.num_blocks), owners = {};
    var lookahead = {};  // blocks that held draft slots this step and went back to the pool after it
    Object.keys(held).forEach(function (rid) {
      held[rid].blocks.forEach(function (b) { (owners[b] = owners[b] || []).push(rid); });
      (held[rid].draft_blocks || []).forEach(function (b) { lookahead[b] = rid; });
    });
    bm.label.textContent = "step " + st.step + ": " + Object.keys(held).length + " requests use " +
      Object.keys(owners).length + " of " + nb + " blocks" + (specText(st) ? "; " + specText(st) : "");
    // Grid of physical blocks.
    // Big pools (a served model has thousands of blocks) get more columns, smaller cells and no numbers.
    var big = nb > 512, cols = big ? 128 : Math.min(32, Math.max(8, Math.ceil(Math.sqrt(nb * 2))));
    var cell = big ? 10 : 26, rows = Math.ceil(nb / cols);
    var g = svg("svg", { id: "block-grid", "class": "pt-chart", viewBox: "0 0 " + (cols * cell + 2) + " " +
      (rows * cell + 2), style: "max-width:" + (cols * cell * 1.2) + "px" }, bm.body);
    for (var b = 0; b < nb; b++) {
      var x = 1 + (b % cols) * cell, y = 1 + Math.floor(b / cols) * cell, who = owners[b];
      var draft = !who && lookahead[b] !== undefined ? lookahead[b] : null;
      var fill = who ? ctx.colorOf(who[0]) : draft !== null ? ctx.colorOf(draft) : "var(--free)";
      var r = svg("rect", { "class": "pt-block" + (who ? " pt-held" : draft !== null ? " pt-draft" : ""),
        "data-block": b, x: x, y: y, width: cell - 2, height: cell - 2, rx: big ? 1 : 3, fill: fill,
        "fill-opacity": draft !== null ? 0.35 : null, stroke: who && who.length > 1 ? "#111" : "none",
        "stroke-width": big ? 1 : 2 }, g);
      tip(r, "block " + b + (who ? ": held by " + who.join(", ") : draft !== null ? ": draft slots of " + draft +
        " this step, returned to the pool after it" : ": not held (free or cached-free)"));
      if (!big) svg("text", { x: x + (cell - 2) / 2, y: y + cell / 2 + 2, "text-anchor": "middle",
        style: "font-size:9px;fill:" + (who ? "#fff" : "#6b7280") + ";pointer-events:none" }, g, String(b));
    }
    // Table: request → token ranges → blocks.
    var t = html("table", { "class": "pt-table", id: "block-table" }, bm.body);
    var hr = html("tr", {}, html("thead", {}, t));
    ["request", "tokens", "logical tokens → physical block", ""].forEach(function (h) { html("th", {}, hr, h); });
    var tb = html("tbody", {}, t);
    var ids = Object.keys(held).sort(function (a, b) { return ctx.order[a] - ctx.order[b]; });
    if (!ids.length) html("td", { colspan: 4 }, html("tr", {}, tb), "no request used blocks in this step");
    ids.forEach(function (rid) {
      var h = held[rid], tr = html("tr", { "data-request": rid }, tb);
      var td = html("td", {}, tr);
      html("span", { "class": "pt-chip", style: "background:" + ctx.colorOf(rid) }, td);
      td.appendChild(document.createTextNode(rid));
      html("td", {}, tr, h.tokens == null ? "≤ " + h.blocks.length * bs : String(h.tokens));
      html("td", { "class": "pt-ranges" }, tr, ranges(h.blocks, h.tokens, bs).join(",  "));
      var done = (st.finished || {})[rid], notes = [];
      if (specText(st, rid)) notes.push(specText(st, rid));
      if ((h.draft_blocks || []).length) notes.push("draft lookahead block" + (h.draft_blocks.length > 1 ? "s " : " ") +
        h.draft_blocks.join(", ") + " returned");
      if (done) notes.push("finished (" + done + "): freed");
      html("td", {}, tr, notes.join("; "));
    });
  }

  function summary(ctx, root) {
    var data = ctx.data, c = data.config || {}, t = data.totals || {};
    var box = html("div", { "class": "pt-summary", id: "summary" }, root);
    var items = [["model", data.model], ["steps", t.steps], ["requests", (data.requests || []).length],
      ["tokens computed", t.scheduled_tokens], ["prefill / decode", t.prefill_tokens + " / " + t.decode_tokens],
      ["recomputed after preemption", t.recomputed_tokens], ["preemptions", t.preemptions],
      ["KV blocks × block size", c.num_blocks + " × " + c.block_size], ["token budget", c.max_num_batched_tokens],
      ["max_num_seqs", c.max_num_seqs], ["prefix caching", c.enable_prefix_caching ? "on" : "off"]];
    if (ctx.spec) {
      items.push(["draft tokens", num(t.draft_tokens)], ["drafts accepted", num(t.accepted_tokens)],
        ["acceptance rate", pct(num(t.accepted_tokens), num(t.draft_tokens))]);
    }
    items.forEach(function (kv) {
      var spec = kv[0].indexOf("draft") >= 0 || kv[0] === "acceptance rate";
      var d = html("div", { "class": spec ? "pt-spec" : null }, box);
      html("b", {}, d, kv[1] === undefined || kv[1] === null ? "–" : String(kv[1]));
      d.appendChild(document.createTextNode(kv[0]));
    });
  }

  // ---- speculative decoding ------------------------------------------------------------------------
  function specPanel(ctx, root) {
    var c = ctx.config.speculative_config || {}, t = ctx.data.totals || {};
    var how = c.method ? c.method + ", up to " + plural(num(c.num_speculative_tokens), "draft token") + " a step" +
      (c.method === "ngram" && c.prompt_lookup_min ?
        " (n-grams of " + c.prompt_lookup_min + "–" + c.prompt_lookup_max + " tokens)" : "") + ". " : "";
    var box = panel(root, "spec", "Speculative decoding",
      how + "Draft tokens are proposed before the step and scored by the model in it; each request keeps the " +
      "accepted prefix of its drafts and one token of the model's own.");
    var drafts = num(t.drafts), pos = t.accepted_per_pos || [];
    var acc = num(t.accepted_tokens), dt = num(t.draft_tokens);
    html("p", { id: "spec-totals" }, box, plural(drafts, "proposal") + ", " + plural(dt, "draft token") + ", " +
      acc + " accepted (" + pct(acc, dt) + ")" +
      (pos.length && drafts ? "; accepted at draft position " + pos.map(function (a, i) {
        return (i + 1) + ": " + pct(a, drafts);
      }).join(", ") : ""));
    var tbl = html("table", { "class": "pt-table", id: "spec-table" }, box);
    var hr = html("tr", {}, html("thead", {}, tbl));
    ["request", "draft tokens", "accepted", "acceptance rate", "generated tokens"].forEach(function (h) {
      html("th", {}, hr, h);
    });
    var tb = html("tbody", {}, tbl), any = false;
    ctx.requests.forEach(function (r) {
      if (!num(r.draft_tokens)) return;
      any = true;
      var tr = html("tr", { "data-request": r.id }, tb), td = html("td", {}, tr);
      html("span", { "class": "pt-chip", style: "background:" + ctx.colorOf(r.id) }, td);
      td.appendChild(document.createTextNode(r.id));
      html("td", {}, tr, String(r.draft_tokens));
      html("td", {}, tr, String(num(r.accepted_tokens)));
      html("td", {}, tr, pct(num(r.accepted_tokens), r.draft_tokens));
      html("td", {}, tr, r.output_tokens == null ? "?" : String(r.output_tokens));
    });
    if (!any) html("td", { colspan: 5 }, html("tr", {}, tb), "no request proposed draft tokens in these steps");
  }

  // ---- entry point ---------------------------------------------------------------------------------
  function render(data, root) {
    root = root || document.getElementById("app");
    data = data || {};
    var steps = data.steps || [], reqs = data.requests || [], prev = root.__ptState || {};
    var ctx = {
      data: data, steps: steps, requests: reqs, config: data.config || {}, cursors: [], order: {},
      first: steps.length ? steps[0].step : num(data.first_step)
    };
    // Speculation is shown when the engine was configured for it or any step scored draft tokens.
    ctx.spec = !!ctx.config.speculative_config || num((data.totals || {}).draft_tokens) > 0 ||
      steps.some(function (s) { return num(s.num_spec_tokens) > 0; });
    reqs.forEach(function (r, k) { ctx.order[r.id] = k; });
    ctx.colorOf = function (rid) {
      var k = ctx.order[rid];
      return PALETTE[(k === undefined ? 0 : k) % PALETTE.length];
    };
    var last = Math.max(0, steps.length - 1), sel = last;
    var wanted = prev.step != null ? (prev.followLatest ? null : prev.step) : data.selected_step;
    if (wanted != null) {
      for (var i = 0; i < steps.length; i++) if (steps[i].step === wanted) sel = i;
    }
    ctx.selIndex = sel;
    ctx.select = function (i) {
      ctx.selIndex = Math.max(0, Math.min(last, i));
      ctx.cursors.forEach(function (c) {
        var x = c.frame.x(ctx.selIndex) + c.frame.band / 2;
        c.line.setAttribute("x1", x); c.line.setAttribute("x2", x);
      });
      drawBlockMap(ctx);
      root.__ptState = { step: steps.length ? steps[ctx.selIndex].step : null, followLatest: ctx.selIndex === last };
      root.setAttribute("data-selected-step", steps.length ? steps[ctx.selIndex].step : "");
    };
    root.textContent = "";
    summary(ctx, root);
    tokenChart(ctx, root);
    queueChart(ctx, root);
    kvChart(ctx, root);
    timeline(ctx, root);
    if (ctx.spec) specPanel(ctx, root);
    blockMap(ctx, root);
    ctx.select(sel);
    root.setAttribute("data-rendered", "1");
    root.setAttribute("data-render-count", String(num(parseInt(root.getAttribute("data-render-count"), 10)) + 1));
    return ctx;
  }

  global.PagedTrace = { render: render, version: 1 };
})(typeof window !== "undefined" ? window : this);
