"use strict";
/* The report's views, drawn from the embedded payload (gzip'd JSON, base64): per request a token strip coloured by
 * probability with the details of any token; the engine's steps; the summary and manifest; and, with a second run,
 * each sequence's first divergence and its cause. Charts are Plotly's; everything else is plain DOM. */
(async function main() {
  const status = document.getElementById("status");
  let D;
  try {
    D = await loadPayload();
  } catch (err) {
    status.textContent = "cannot read the embedded trace: " + err;
    return;
  }
  const PAGE = 100; /* requests listed per page */
  const A = D.run, B = D.against;
  const pieces = D.pieces, procs = D.processors;
  let colourBy = "raw";
  let pinned = null; /* {run, seq, k, box} of a clicked token and its strip */

  /* ---------------------------------------------------------------- helpers */
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c);
    return node;
  }
  const fmt = (x, d = 4) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
  const piece = (id) => (id in pieces ? pieces[id] : "#" + id);
  const visible = (s) => s.replace(/\n/g, "↵\n").replace(/\t/g, "→\t");
  function colour(lp) {
    if (lp === null || lp === undefined) return "#e4e7ec";
    const p = Math.exp(lp);
    return `hsl(${Math.round(120 * p)}, ${p > 0.5 ? 60 : 80}%, ${p > 0.5 ? 82 : 78}%)`;
  }
  function seqName(run, i) {
    const r = run.requests[i];
    return r.stream ? `${r.id}#${r.stream}` : r.id;
  }
  async function loadPayload() {
    const text = document.getElementById("payload").textContent.trim();
    const bin = atob(text);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return JSON.parse(await new Response(stream).text());
  }
  function plot(div, figure) {
    if (!figure || typeof Plotly === "undefined") {
      div.textContent = "(no data for this figure)";
      return;
    }
    Plotly.newPlot(div, figure.data, figure.layout, { responsive: true, displaylogo: false });
  }

  /* ---------------------------------------------------------------- tabs */
  const tabs = document.getElementById("tabs");
  const views = {};
  function addTab(name, label, build) {
    const section = document.getElementById("view-" + name);
    let built = false;
    const button = el("button", { "data-view": name, text: label, onclick: () => show(name) });
    tabs.append(button);
    views[name] = { section, button, build: () => { if (!built) { built = true; build(section); } } };
  }
  function show(name) {
    for (const [n, v] of Object.entries(views)) {
      v.section.classList.toggle("active", n === name);
      v.button.classList.toggle("active", n === name);
    }
    views[name].build();
    window.dispatchEvent(new Event("resize")); /* Plotly sizes figures drawn while hidden */
  }

  /* ---------------------------------------------------------------- token details */
  function detailPane() {
    const pane = el("div", { class: "pane sticky detail" }, el("h2", { text: "Token" }),
      el("p", { class: "muted", text: "Hover over a token to see its details; click to pin them (then ← / → move along the strip)." }));
    return pane;
  }
  function kv(dl, label, field, value, shown) {
    dl.append(el("dt", { text: label }),
      el("dd", { "data-field": field, "data-value": value === null || value === undefined ? "" : String(value) },
        shown !== undefined ? shown : (value === null || value === undefined ? "–" : String(value))));
  }
  function showDetail(pane, run, s, k, label) {
    const q = run.seqs[s];
    const tok = q.tok[k];
    pane.replaceChildren(el("h2", { text: (label ? label + ": " : "") + seqName(run, s) + ", token " + k }));
    const dl = el("dl", { class: "kv", id: "detail" });
    kv(dl, "token", "token", tok, el("span", {}, el("span", { class: "piece", text: piece(tok) }), ` id ${tok}`));
    kv(dl, "position", "position", q.pos[k]);
    kv(dl, "raw logprob", "raw", q.raw[k], q.raw[k] === null ? "–" : `${q.raw[k]} (p ${fmt(Math.exp(q.raw[k]))})`);
    kv(dl, "processed logprob", "proc", q.proc[k],
      q.proc[k] === null ? "–" : `${q.proc[k]} (p ${fmt(Math.exp(q.proc[k]))})`);
    kv(dl, "support", "support", q.sup[k], q.sup[k] === null ? "–" : `${q.sup[k]} tokens kept`);
    kv(dl, "noise", "noise", q.noise[k], q.noise[k] === null ? "none (argmax)" : String(q.noise[k]));
    kv(dl, "processors", "processors", (procs[q.pr[k]] || []).join(" → "));
    kv(dl, "step", "step", q.step[k]);
    kv(dl, "batch", "batch", q.batch[k], q.batch[k] === null ? "–" : `${q.batch[k]} sequences, ${q.stok[k]} tokens`);
    kv(dl, "emitted at", "t", q.t[k], q.t[k] === null ? "–" : `${fmt(q.t[k], 3)} s`);
    kv(dl, "logits sha256", "digest", q.dig[k], q.dig[k] ? q.dig[k] + "…" : "–");
    if (q.ga && q.ga[k] !== null) kv(dl, "grammar allowed", "grammar", q.ga[k], `${q.ga[k]} tokens`);
    if (q.origin && q.origin[k]) kv(dl, "speculation", "origin", q.origin[k]);
    if (q.dl && q.dl[k] !== null) kv(dl, "draft logprob", "draft", q.dl[k]);
    if (q.sp && q.sp[k] !== null) kv(dl, "drafts", "spec", q.sp[k], `${q.sa[k]} of ${q.sp[k]} accepted`);
    if (q.fin && q.fin[k]) kv(dl, "finish", "finish", q.fin[k], `${q.fin[k]} (${q.stop ? q.stop[k] : ""})`);
    if (q.err && q.err[k]) kv(dl, "error", "error", q.err[k]);
    pane.append(dl);
    const alternatives = topTable(q, k);
    if (alternatives) {
      pane.append(el("h2", { text: "Top alternatives", style: "margin-top:10px" }), alternatives.table);
      const fig = el("div", { class: "alt-figure", style: "height:220px" });
      pane.append(fig);
      plot(fig, alternatives.figure);
    }
  }
  function topTable(q, k) {
    const tr = q.tr ? q.tr[k] : null, tp = q.tp ? q.tp[k] : null;
    if (!tr && !tp) return null;
    const ids = [];
    for (const list of [tr, tp]) if (list) for (const id of list[0]) if (!ids.includes(id)) ids.push(id);
    const lookup = (list, id) => { if (!list) return null; const j = list[0].indexOf(id); return j < 0 ? null : list[1][j]; };
    const table = el("table", { class: "alternatives" },
      el("tr", {}, el("th", { text: "token" }), el("th", { class: "num", text: "raw logprob" }),
        el("th", { class: "num", text: "processed" })));
    for (const id of ids) {
      const raw = lookup(tr, id), proc = lookup(tp, id);
      table.append(el("tr", { class: id === q.tok[k] ? "chosen" : null, "data-token": id },
        el("td", {}, el("span", { class: "piece", text: visible(piece(id)) }), el("span", { class: "muted", text: ` ${id}` })),
        el("td", { class: "num", text: raw === null ? "–" : `${fmt(raw)} (${pct(Math.exp(raw))})` }),
        el("td", { class: "num", text: proc === null ? "masked / not in top" : `${fmt(proc)} (${pct(Math.exp(proc))})` })));
    }
    const labels = ids.map((id) => `${JSON.stringify(piece(id))} ${id}`); /* pieces alike (byte tokens): a bar each */
    const figure = {
      data: [
        { type: "bar", name: "raw", x: labels, y: ids.map((id) => { const v = lookup(tr, id); return v === null ? 0 : Math.exp(v); }), marker: { color: "#98a2b3" } },
        { type: "bar", name: "processed", x: labels, y: ids.map((id) => { const v = lookup(tp, id); return v === null ? 0 : Math.exp(v); }), marker: { color: "#2f6fdd" } },
      ],
      layout: { barmode: "group", margin: { l: 36, r: 6, t: 6, b: 60 }, legend: { orientation: "h", y: 1.15 },
        yaxis: { title: { text: "probability" }, range: [0, 1] }, font: { size: 10 } },
    };
    return { table, figure };
  }

  /* ---------------------------------------------------------------- a token strip */
  function strip(run, s, opts) {
    const q = run.seqs[s];
    const box = el("div", { class: "strip", "data-seq": s, "data-run": opts.runName });
    const frag = document.createDocumentFragment();
    for (let k = 0; k < q.tok.length; k++) {
      const lp = colourBy === "raw" ? q.raw[k] : q.proc[k];
      let cls = "tok";
      if (q.tok[k] < 0) cls += " err";
      if (opts.divergeAt !== undefined && k === opts.divergeAt) cls += " first-div";
      else if (opts.divergeAt !== undefined && k > opts.divergeAt) cls += " after-div";
      const span = el("span", { class: cls, "data-i": k, style: `background:${colour(lp)}` });
      span.textContent = q.tok[k] < 0 ? "⚠" : visible(piece(q.tok[k]));
      frag.append(span);
    }
    box.append(frag);
    const target = (ev) => ev.target.closest ? ev.target.closest(".tok") : null;
    box.addEventListener("mouseover", (ev) => {
      const t = target(ev);
      if (t && !pinned) showDetail(opts.pane, run, s, +t.dataset.i, opts.label);
    });
    box.addEventListener("click", (ev) => {
      const t = target(ev);
      if (!t) return;
      document.querySelectorAll(".tok.focus").forEach((n) => n.classList.remove("focus"));
      const k = +t.dataset.i;
      if (pinned && pinned.run === run && pinned.seq === s && pinned.k === k) {
        pinned = null;
      } else {
        pinned = { run, seq: s, k, box };
        t.classList.add("focus");
        t.scrollIntoView({ block: "nearest" });
      }
      showDetail(opts.pane, run, s, k, opts.label);
    });
    return box;
  }
  function colourControls(onchange) {
    const radio = (value, label) => el("label", {},
      el("input", { type: "radio", name: "colour-" + Math.random(), value, ...(colourBy === value ? { checked: "" } : {}),
        onchange: () => { colourBy = value; onchange(); } }), " " + label);
    return el("div", { class: "controls" }, el("span", { text: "colour by" }), radio("raw", "raw probability"),
      radio("proc", "processed probability"),
      el("span", { class: "legend" }, "p 0", el("span", { class: "bar" }), "1"));
  }

  /* ---------------------------------------------------------------- requests view */
  function requestsView(section) {
    const list = el("div", { class: "pane sticky" });
    const middle = el("div", { class: "pane" });
    const pane = detailPane();
    section.append(el("div", { class: "layout" }, list, middle, pane));
    let page = 0, filter = "", selected = 0;
    const matches = () => A.requests.map((r, i) => i).filter((i) => {
      if (!filter) return true;
      const r = A.requests[i];
      return seqName(A, i).toLowerCase().includes(filter) || (r.prompt || "").toLowerCase().includes(filter);
    });
    function drawList() {
      const idx = matches();
      const pages = Math.max(1, Math.ceil(idx.length / PAGE));
      page = Math.min(page, pages - 1);
      const table = el("table", { id: "req-table" },
        el("tr", {}, el("th", { text: "request" }), el("th", { class: "num", text: "tokens" }),
          el("th", { text: "finish" }), el("th", { class: "num", text: "geo. mean p", title: "exp(mean raw logprob): the geometric mean of the chosen tokens' probabilities" })));
      for (const i of idx.slice(page * PAGE, (page + 1) * PAGE)) {
        const r = A.requests[i];
        table.append(el("tr", { class: "req" + (i === selected ? " selected" : ""), "data-index": i,
          onclick: () => { selected = i; drawList(); drawRequest(); } },
          el("td", { text: seqName(A, i) }), el("td", { class: "num", text: r.tokens }),
          el("td", { text: r.finish || "–" }),
          el("td", { class: "num", text: r.mean_raw_lp === null ? "–" : fmt(Math.exp(r.mean_raw_lp), 3) })));
      }
      const search = el("input", { type: "search", placeholder: "filter by id or prompt", value: filter });
      search.addEventListener("change", () => { filter = search.value.toLowerCase(); page = 0; drawList(); });
      list.replaceChildren(el("h2", { text: `Requests (${A.requests.length} sequences, ${A.rows} tokens)` }),
        el("div", { class: "pager" }, search),
        el("div", { class: "pager" },
          el("button", { text: "‹", onclick: () => { page = Math.max(0, page - 1); drawList(); } }),
          el("span", { id: "page-label", text: `page ${page + 1} of ${pages} (${idx.length} shown)` }),
          el("button", { text: "›", onclick: () => { page = Math.min(pages - 1, page + 1); drawList(); } })),
        table);
    }
    function drawRequest() {
      pinned = null;
      const r = A.requests[selected];
      if (!r) { middle.replaceChildren(el("p", { text: "This run has no requests." })); return; }
      const facts = [`${r.tokens} tokens`, r.finish ? `finish ${r.finish} (${r.stop})` : "unfinished",
        r.temperature !== null && r.temperature !== undefined ? `temperature ${r.temperature}` : null,
        r.top_p !== null && r.top_p !== undefined && r.top_p < 1 ? `top_p ${r.top_p}` : null,
        r.top_k > 0 ? `top_k ${r.top_k}` : null, r.seed !== null ? `seed ${r.seed}` : null,
        r.ttft !== null ? `TTFT ${fmt(r.ttft, 3)} s` : null, r.tpot !== null ? `TPOT ${fmt(r.tpot * 1e3, 1)} ms` : null,
        r.preemptions ? `${r.preemptions} preemptions` : null, r.origin_engine ? `from ${r.origin_engine}` : null]
        .filter(Boolean).join(" · ");
      middle.replaceChildren(el("h2", { id: "request-title", "data-index": selected, text: seqName(A, selected) }),
        el("p", { class: "muted", text: facts }),
        colourControls(drawRequest),
        el("div", { class: "prompt", title: "prompt", text: r.prompt ? `${r.prompt_tokens} prompt tokens: ${r.prompt}` : "(prompt not recorded)" }),
        Object.assign(strip(A, selected, { pane, runName: "a" }), { id: "strip" }));
    }
    drawList();
    drawRequest();
  }

  /* ---------------------------------------------------------------- compare view */
  function compareView(section) {
    const divs = D.divergences;
    const index = (run) => Object.fromEntries(run.requests.map((r, i) => [r.id + "\u0000" + r.stream, i]));
    const ia = index(A), ib = index(B);
    const left = el("div", { class: "pane sticky" });
    const middle = el("div", { class: "pane" });
    const pane = detailPane();
    section.append(el("div", { class: "layout" }, left, middle, pane));
    const counts = {};
    for (const d of divs) counts[d.kind] = (counts[d.kind] || 0) + 1;
    const table = el("table", { id: "div-table" },
      el("tr", {}, el("th", { text: "sequence" }), el("th", { class: "num", text: "position" }),
        el("th", { text: "cause" })));
    let selected = divs.length ? 0 : -1;
    divs.forEach((d, j) => {
      table.append(el("tr", { class: "req" + (j === selected ? " selected" : ""), "data-request": d.request_id,
        "data-stream": d.stream, "data-position": d.position, "data-kind": d.kind,
        onclick: (ev) => { selected = j; table.querySelectorAll("tr.req").forEach((t) => t.classList.remove("selected"));
          ev.currentTarget.classList.add("selected"); drawPair(); } },
        el("td", { text: d.stream ? `${d.request_id}#${d.stream}` : d.request_id }), el("td", { class: "num", text: d.position }),
        el("td", { text: d.kind })));
    });
    const same = D.compared_sequences - divs.length;
    left.append(el("h2", { text: "Where the runs part" }),
      el("p", { id: "compare-summary", text: `${divs.length} of ${D.compared_sequences} sequences diverge; ${same} are identical in every compared field.` }),
      el("p", { class: "muted", text: Object.entries(counts).map(([k, n]) => `${k}: ${n}`).join(" · ") }),
      el("p", { class: "muted", text: `A: ${A.dir}` }), el("p", { class: "muted", text: `B: ${B.dir}` }),
      table);
    function drawPair() {
      pinned = null;
      if (selected < 0) {
        middle.replaceChildren(el("h2", { text: "No divergence" }),
          el("p", { text: "Every sequence has the same rows in both runs (tokens, logprob bits, logits and kept-set digests, noise)." }));
        return;
      }
      const d = divs[selected];
      const key = d.request_id + "\u0000" + d.stream;
      const parts = [el("h2", { id: "pair-title", text: d.stream ? `${d.request_id}#${d.stream}` : d.request_id }),
        el("p", {}, `First divergence at position ${d.position} (output token ${d.index}): `,
          el("span", { class: "cause", id: "div-cause", "data-kind": d.kind, "data-position": d.position, text: d.cause })),
        el("p", { id: "token-divergence", "data-index": d.token_index === null ? "" : d.token_index,
          text: d.a_token === null || d.b_token === null ? "One run has no row here: its tokens stop earlier, or it lacks the sequence."
            : d.token_index === null ? "The tokens both runs have agree; they part in other fields only."
            : `The tokens first differ at output token ${d.token_index}` + (d.token_index === d.index ? " (here)." : ".") }),
        el("p", { class: "muted", text: `differing fields: ${d.fields.join(", ")}; token A ${d.a_token === null ? "none" : JSON.stringify(piece(d.a_token)) + " (" + d.a_token + ")"}, token B ${d.b_token === null ? "none" : JSON.stringify(piece(d.b_token)) + " (" + d.b_token + ")"}` }),
        colourControls(drawPair)];
      for (const [name, run, map] of [["A", A, ia], ["B", B, ib]]) {
        const s = map[key];
        const box = el("div", { class: "pair" }, el("h3", { text: `run ${name}` }));
        if (s === undefined) box.append(el("p", { class: "muted", text: "no such sequence in this run" }));
        else {
          const at = run.seqs[s].pos.indexOf(d.position);
          box.append(Object.assign(strip(run, s, { pane, runName: name.toLowerCase(), label: "run " + name,
            divergeAt: at < 0 ? run.seqs[s].pos.length : at }), { id: "strip-" + name.toLowerCase() }));
        }
        parts.push(box);
      }
      middle.replaceChildren(...parts);
    }
    drawPair();
  }

  /* ---------------------------------------------------------------- engine and summary views */
  function engineView(section) {
    const fig = el("div", { class: "figure", id: "timeline", style: "height:720px" });
    section.append(el("div", { class: "pane" }, el("h2", { text: "Engine timeline: one bar per step (one forward)" }),
      el("p", { class: "muted", text: D.steps_note }), fig));
    plot(fig, D.figures.timeline);
  }
  function summaryView(section) {
    const s = A.summary || {};
    const cards = el("div", { class: "cards" });
    const card = (k, v) => cards.append(el("div", { class: "card" }, el("div", { class: "v", text: v }), el("div", { class: "k", text: k })));
    card("sequences", A.requests.length);
    card("sampled tokens", A.rows);
    if (s.output_tok_per_s !== undefined) card("output tok/s", fmt(s.output_tok_per_s, 1));
    if (s.ttft_p50_s !== undefined && s.ttft_p50_s !== null) card("TTFT p50", fmt(s.ttft_p50_s, 3) + " s");
    if (s.tpot_p50_s !== undefined && s.tpot_p50_s !== null) card("TPOT p50", fmt(s.tpot_p50_s * 1e3, 1) + " ms");
    if (s.num_preemptions !== undefined) card("preemptions", s.num_preemptions);
    if (s.steps !== undefined) card("steps", s.steps);
    const manifest = el("dl", { class: "kv", id: "manifest" });
    for (const [k, v] of Object.entries(A.manifest || {})) {
      if (v !== null && typeof v === "object") continue;
      manifest.append(el("dt", { text: k }), el("dd", { "data-key": k, text: String(v) }));
    }
    const figs = el("div", { class: "layout", style: "grid-template-columns: 1fr 1fr" });
    for (const name of ["probabilities", "latency"]) {
      const div = el("div", { class: "figure pane", id: "figure-" + name });
      figs.append(div);
      setTimeout(() => plot(div, D.figures[name]), 0);
    }
    section.append(cards, figs,
      el("div", { class: "layout", style: "grid-template-columns: 1fr 1fr; margin-top: 12px" },
        el("div", { class: "pane" }, el("h2", { text: "Manifest" }), manifest),
        el("div", { class: "pane" }, el("h2", { text: "Config (config.yaml)" }), el("pre", { class: "config", text: A.config || "(none)" }))));
  }

  /* with a token pinned, the arrow keys pin the previous / next one of the same strip */
  document.addEventListener("keydown", (ev) => {
    if (!pinned || (ev.key !== "ArrowLeft" && ev.key !== "ArrowRight") || !pinned.box.isConnected) return;
    const next = pinned.box.querySelector(`.tok[data-i="${pinned.k + (ev.key === "ArrowRight" ? 1 : -1)}"]`);
    if (!next) return;
    ev.preventDefault();
    next.click();
  });

  if ((D.notes || []).length) /* stopped early, failed, requests refused: said before any figure */
    document.querySelector("header").after(el("div", { id: "notes" }, ...D.notes.map((t) => el("p", { text: t }))));
  addTab("requests", "Requests", requestsView);
  if (B) addTab("compare", "Compare", compareView);
  addTab("engine", "Engine", engineView);
  addTab("summary", "Summary", summaryView);
  show(B ? "compare" : "requests");
  status.textContent = `${A.requests.length} sequences, ${A.rows} tokens` + (B ? ` · against ${B.requests.length} sequences` : "");
  document.body.dataset.ready = "1";
})();
