"use strict";
// swiftlm web: the page over the JSON API of `swiftlm web` (swiftlm/web/api.py). Every text
// that comes from a run, a log or a model is set with textContent, never parsed as HTML.

const $ = (id) => document.getElementById(id);
const el = (tag, props = {}, ...children) => {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
};

async function api(path, body) {
  const options = body === undefined ? {} : {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const reply = await fetch(path, {cache: "no-store", ...options});
  const data = await reply.json().catch(() => ({error: `HTTP ${reply.status}`}));
  if (!reply.ok) throw new Error(data.error || `HTTP ${reply.status}`);
  return data;
}

// ---- tabs -----------------------------------------------------------------------------------
let activeTab = "configure";
function showTab(name) {
  activeTab = name;
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.dataset.tab === name);
  for (const p of document.querySelectorAll(".panel")) p.classList.toggle("active", p.id === "panel-" + name);
  if (name === "chat" || name === "export" || name === "eval") loadModels();
}
for (const b of document.querySelectorAll("nav button")) b.onclick = () => showTab(b.dataset.tab);

// ---- forms from the flags' documentation ----------------------------------------------------
function fieldInput(field, values, onChange) {
  let input;
  if (field.kind === "choice") {
    input = el("select");
    if (field.optional) input.append(el("option", {value: "", textContent: "(default)"}));
    for (const c of field.choices) input.append(el("option", {value: c, textContent: c}));
  } else {
    input = el("input", {type: "text", placeholder: field.kind === "list" ? "values separated by spaces" : ""});
  }
  input.id = "flag-" + field.name;
  input.value = values[field.name] ?? field.default;
  input.oninput = input.onchange = () => { values[field.name] = input.value; onChange(field, input); };
  return input;
}

function renderFields(fields, values, onChange) {
  return fields.map((field) => {
    const row = el("div", {className: "field"});
    row.dataset.flag = field.name;
    const input = fieldInput(field, values, (f, i) => {
      row.classList.toggle("changed", i.value.trim() !== f.default);
      onChange();
    });
    row.append(el("label", {htmlFor: input.id, textContent: "--" + field.name}), input,
               el("div", {className: "help", textContent: field.help}));
    return row;
  });
}

function renderSections(sections, values, onChange) {
  return sections.map((s) => el("fieldset", {}, el("legend", {textContent: s.name}),
                                ...renderFields(s.fields, values, onChange)));
}

// ---- configure ------------------------------------------------------------------------------
let formValues = {};
let formDefaults = {};
function changedValues() {
  const out = {};
  for (const [k, v] of Object.entries(formValues)) if (v.trim() !== formDefaults[k]) out[k] = v;
  return out;
}

async function loadForm() {
  const command = $("command").value;
  const schema = await api("/api/form/" + command);
  formValues = {}; formDefaults = {};
  const tabs = $("form-tabs"), form = $("form");
  tabs.replaceChildren(); form.replaceChildren();
  schema.tabs.forEach((tab, i) => {
    const sheet = el("div", {className: "tab-sheet"});
    sheet.dataset.tab = tab.name;
    for (const s of tab.sections) for (const f of s.fields) formDefaults[f.name] = f.default;
    sheet.append(...renderSections(tab.sections, formValues, scheduleCommand));
    if (!tab.sections.length) sheet.append(el("p", {className: "note",
      textContent: `swiftlm ${command} has no flags of its own here; the method is the command.`}));
    const button = el("button", {textContent: tab.name});
    button.dataset.tab = tab.name;
    button.onclick = () => selectFormTab(tab.name);
    tabs.append(button); form.append(sheet);
  });
  selectFormTab(schema.tabs[0].name);
  scheduleCommand();
}

function selectFormTab(name) {
  for (const b of $("form-tabs").children) b.classList.toggle("active", b.dataset.tab === name);
  for (const s of $("form").children) s.hidden = s.dataset.tab !== name;
  $("data-tools").hidden = name !== "Data";
}

let commandTimer = null;
function scheduleCommand() { clearTimeout(commandTimer); commandTimer = setTimeout(updateCommand, 200); }

function formBody() {
  return {command: $("command").value, name: $("run-name").value.trim(), values: changedValues()};
}

async function updateCommand() {
  try {
    const plan = await api("/api/command", formBody());
    $("command-line").textContent = plan.command_line;
    $("command-note").textContent = plan.note;
    $("form-error").textContent = "";
    $("start").disabled = false;
  } catch (e) {
    $("command-line").textContent = "(fix the error below first)";
    $("command-note").textContent = "";
    $("form-error").textContent = e.message;
    $("start").disabled = true;
  }
  document.body.dataset.ready = "true";
}

function defaultRunName() {
  const t = new Date(), pad = (n) => String(n).padStart(2, "0");
  return `${$("command").value}-${t.getFullYear()}${pad(t.getMonth() + 1)}${pad(t.getDate())}-` +
         `${pad(t.getHours())}${pad(t.getMinutes())}${pad(t.getSeconds())}`;
}

$("command").onchange = () => { $("run-name").value = defaultRunName(); loadForm(); };
$("run-name").oninput = scheduleCommand;
$("copy").onclick = () => navigator.clipboard?.writeText($("command-line").textContent);

$("preview-button").onclick = async () => {
  const box = $("preview");
  box.replaceChildren(el("p", {className: "note", textContent: "reading..."}));
  try {
    const reply = await api("/api/preview", formBody());
    box.replaceChildren(...reply.datasets.map(renderPreview));
  } catch (e) {
    box.replaceChildren(el("div", {className: "error", textContent: e.message}));
  }
};

// A sample as a person reads it: one line per message, else its fields.
function sampleText(sample) {
  if (Array.isArray(sample.messages)) {
    return sample.messages.map((m) => `${m.role}: ${typeof m.content === "string" ? m.content : JSON.stringify(m.content)}`).join("\n");
  }
  const shown = {...sample}; delete shown.source;
  return Object.entries(shown).map(([k, v]) => `${k}: ${typeof v === "string" ? v : JSON.stringify(v)}`).join("\n");
}

function renderPreview(d) {
  const part = el("div", {className: "dataset-preview"});
  part.append(el("h4", {textContent: d.dataset + (d.checked ? ` (${d.checked} rows checked)` : "")}));
  if (d.error) { part.append(el("div", {className: "error", textContent: d.error})); return part; }
  const body = el("tbody");
  for (const row of d.rows) body.append(el("tr", {}, el("td", {textContent: row.source}),
                                           el("td", {textContent: sampleText(row)})));
  part.append(el("table", {className: "preview-table"}, body));
  if (d.errors.length) part.append(el("div", {className: "error preview-errors", textContent: d.errors.join("\n")}));
  return part;
}

$("start").onclick = async () => {
  try {
    const run = await api("/api/runs", formBody());
    selectRun(run.name);
    showTab("runs");
    $("run-name").value = defaultRunName(); scheduleCommand();
  } catch (e) { $("form-error").textContent = e.message; }
};

// ---- runs -----------------------------------------------------------------------------------
let selectedRun = null;
function selectRun(name) {
  selectedRun = name;
  $("run-detail").hidden = false;
  $("run-title").textContent = name;
  $("dashboard").src = `/runs/${encodeURIComponent(name)}/dashboard/`;
  refreshRuns();
}

function fmt(x) { return x === undefined || x === null ? "" : (typeof x === "number" ? +x.toPrecision(5) : x); }

async function refreshRuns() {
  let data;
  try { data = await api("/api/runs"); } catch (e) { return; }
  $("runs-dir").textContent = data.runs_dir;
  const body = $("runs-table").tBodies[0];
  body.replaceChildren(...data.runs.map((r) => {
    const tr = el("tr", {}, el("td", {textContent: r.name}),
      el("td", {className: "state state-" + r.state, textContent: r.state}),
      el("td", {textContent: fmt(r.step)}), el("td", {textContent: fmt(r.loss)}),
      el("td", {textContent: r.command_line || "(started outside the UI)"}));
    tr.dataset.run = r.name; tr.classList.toggle("selected", r.name === selectedRun);
    tr.onclick = () => selectRun(r.name);
    return tr;
  }));
  if (selectedRun) await refreshRun();
}

async function refreshRun() {
  let r;
  try { r = await api("/api/runs/" + encodeURIComponent(selectedRun)); } catch (e) { return; }
  $("run-state").textContent = r.state; $("run-state").className = "state state-" + r.state;
  $("run-state").dataset.state = r.state;
  $("run-step").textContent = fmt(r.step); $("run-step").dataset.step = r.step ?? "";
  $("run-loss").textContent = fmt(r.loss); $("run-loss").dataset.loss = r.loss ?? "";
  $("run-message").textContent = r.message || "";
  $("run-command").textContent = r.command_line || "";
  $("stop").disabled = r.state !== "running";
  $("resume").disabled = !r.command_line || r.state === "running" || r.state === "finished";
  const log = $("run-log"), atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.textContent = r.log; if (atEnd) log.scrollTop = log.scrollHeight;
}

async function runAction(action) {
  try { await api(`/api/runs/${encodeURIComponent(selectedRun)}/${action}`, {}); $("run-error").textContent = ""; }
  catch (e) { $("run-error").textContent = e.message; }
  refreshRuns();
}
$("stop").onclick = () => runAction("stop");
$("resume").onclick = () => runAction("resume");

// ---- models for chat, export and evaluation -------------------------------------------------
async function loadModels() {
  let data;
  try { data = await api("/api/models"); } catch (e) { return; }
  for (const select of [$("chat-model"), ...document.querySelectorAll(".tool-model")]) {
    const keep = select.value;
    select.replaceChildren(...data.models.map((m) =>
      el("option", {value: m.path, textContent: `${m.run} / ${m.label}`})));
    if ([...select.options].some((o) => o.value === keep)) select.value = keep;
  }
}

// ---- chat -----------------------------------------------------------------------------------
let conversation = [];
let chatReady = false;
$("chat-load").onclick = async () => {
  try { await api("/api/chat", {model: $("chat-model").value}); $("chat-error").textContent = ""; }
  catch (e) { $("chat-error").textContent = e.message; }
  refreshChat();
};

$("chat-unload").onclick = async () => {
  try { await api("/api/chat/unload", {}); } catch (e) { $("chat-error").textContent = e.message; }
  refreshChat();
};

async function refreshChat() {
  let s;
  try { s = await api("/api/chat"); } catch (e) { return; }
  chatReady = s.ready;
  const status = s.state === "none" ? "no model loaded" :
    s.ready ? `ready: ${s.model}` : s.state === "running" ? `loading ${s.model} ...` : `server ${s.state}`;
  $("chat-status").textContent = status; $("chat-status").dataset.ready = String(s.ready);
  $("chat-server-log").textContent = s.ready ? "" : (s.log || "");
}

$("chat-clear").onclick = () => { conversation = []; $("chat-log").replaceChildren(); };
$("chat-form").onsubmit = async (event) => {
  event.preventDefault();
  const text = $("chat-message").value.trim();
  if (!text) return;
  $("chat-message").value = "";
  conversation.push({role: "user", content: text});
  const n = $("chat-log").children.length;
  $("chat-log").append(el("div", {className: "msg user", id: "msg-" + n, textContent: text}));
  const answer = el("div", {className: "msg assistant", id: "msg-" + (n + 1)});
  $("chat-log").append(answer);
  try {
    answer.textContent = await streamAnswer(answer);
    conversation.push({role: "assistant", content: answer.textContent});
  } catch (e) { $("chat-error").textContent = e.message; }
  answer.dataset.done = "true";
};

async function streamAnswer(answer) {
  const request = {messages: conversation, stream: true, max_tokens: 256,
                   temperature: Number($("chat-temperature").value)};
  const reply = await fetch("/api/chat/completions", {method: "POST",
    headers: {"Content-Type": "application/json"}, body: JSON.stringify(request)});
  if (!reply.ok) throw new Error((await reply.json().catch(() => ({}))).error || `HTTP ${reply.status}`);
  const reader = reply.body.getReader(), decoder = new TextDecoder();
  let buffer = "", text = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return text;
    buffer += decoder.decode(value, {stream: true});
    const lines = buffer.split("\n"); buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      const chunk = JSON.parse(line.slice(6));
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      text += chunk.choices?.[0]?.delta?.content || "";
      answer.textContent = text;
    }
  }
}

// ---- export and evaluation ------------------------------------------------------------------
const toolValues = {export: {}, eval: {}};
const toolDefaults = {export: {}, eval: {}};
async function loadToolForm(panel) {
  const kind = panel.dataset.tool;
  const schema = await api("/api/form/" + kind);
  const sections = schema.tabs.flatMap((t) => t.sections);
  for (const s of sections) for (const f of s.fields) toolDefaults[kind][f.name] = f.default;
  const [own, ...rest] = renderSections(sections, toolValues[kind], () => {});
  const more = el("details", {}, el("summary", {textContent: "more flags (model, data, generation ...)"}), ...rest);
  panel.querySelector(".tool-form").replaceChildren(own, more);
  panel.querySelector(".tool-start").onclick = async () => {
    const values = {};
    for (const [k, v] of Object.entries(toolValues[kind])) if (v.trim() !== toolDefaults[kind][k]) values[k] = v;
    try {
      await api("/api/jobs/" + kind, {model: panel.querySelector(".tool-model").value, values});
      panel.querySelector(".tool-error").textContent = "";
    } catch (e) { panel.querySelector(".tool-error").textContent = e.message; }
    refreshJobs(panel);
  };
}

// eval's summary as one line per metric (mean and its confidence interval); export's files.
function resultText(results) {
  const lines = [];
  for (const [task, info] of Object.entries(results["summary.json"]?.tasks || {})) {
    for (const [metric, m] of Object.entries(info.metrics || {})) {
      lines.push(`${task.padEnd(24)} ${metric.padEnd(16)} ${fmt(m.mean)}  [${fmt(m.low)}, ${fmt(m.high)}]  n=${m.n}`);
    }
  }
  if (results.files) lines.push("files:", ...results.files.map((f) => "  " + f));
  return lines.join("\n") || JSON.stringify(results, null, 1);
}

async function refreshJobs(panel) {
  let data;
  try { data = await api("/api/jobs/" + panel.dataset.tool); } catch (e) { return; }
  panel.querySelector(".tool-jobs").replaceChildren(...data.jobs.map((j) => el("div", {className: "job"},
    el("h4", {textContent: `${j.name}: `}, el("span", {className: "state state-" + j.state, textContent: j.state})),
    el("pre", {textContent: j.command_line}),
    Object.keys(j.results).length ? el("pre", {className: "job-results", textContent: resultText(j.results)}) : "",
    el("pre", {className: "job-log", textContent: j.log}))));
}

// ---- start ----------------------------------------------------------------------------------
$("run-name").value = defaultRunName();
loadForm();
for (const panel of document.querySelectorAll("[data-tool]")) loadToolForm(panel);
setInterval(() => {
  if (activeTab === "runs") refreshRuns();
  if (activeTab === "chat") refreshChat();
  if (activeTab === "export" || activeTab === "eval") refreshJobs($("panel-" + activeTab));
}, 1000);
refreshRuns();
