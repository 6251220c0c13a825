// Concepts: every concept with its collection status on each model (paged, live while collecting),
// a form that uploads a JSONL dataset as the README's `curl -F name=... -F models=... -F
// dataset=@file` does (POST /concepts, multipart), and each concept's page: its data, its
// statistics per model with the collection job's live progress, its engram map per ready model, and
// its deletion (DELETE /concepts/{name}).
import { all, followJob, get, request } from "../api.js";
import { actionButton, confirmed, fill, fmtNum, fmtTime, h, kv, link, problemBox, section, table } from "../ui.js";
import { chosen, collecting, drawMap, jobLine, labelTags, pagedTable, parseLabels, refusal, stateCell } from "./mc_common.js";

const POLL_MS = 1500;

function conceptHref(name) { return `#/concepts/${encodeURIComponent(name)}`; }
function modelHref(modelId) { return `#/models/${encodeURIComponent(modelId)}`; }
function field(label, input) { return h("label", {}, label, input); }

/** Each model's collection state as "model: badge" lines. */
function statesCell(concept) {
  const entries = Object.entries(concept.models || {});
  if (!entries.length) return h("span", { class: "muted" }, "—");
  return h("div", { class: "model-states" }, entries.map(([modelId, state]) =>
    h("div", { "data-model": modelId }, link(modelHref(modelId), modelId), " ", stateCell(state))));
}

const CONCEPT_COLUMNS = [
  { label: "concept", value: (c) => link(conceptHref(c.name), c.name) },
  { label: "role", value: (c) => c.role },
  { label: "statistics per model", value: statesCell },
  { label: "records", value: (c) => fmtNum(c.num_records), num: true },
  { label: "labels", value: (c) => labelTags(c.labels) },
  { label: "created", value: (c) => fmtTime(c.created_at) },
];

function formInputs(models) {
  return {
    name: h("input", { name: "name", required: true, placeholder: "forget", "data-testid": "concept-name", size: 20 }),
    models: h("select", { name: "models", multiple: true, size: Math.min(5, Math.max(2, models.length)), "data-testid": "concept-models" },
      models.map((m) => h("option", { value: m.model_id, selected: models.length === 1 }, m.model_id))),
    dataset: h("input", { name: "dataset", type: "file", accept: ".jsonl,.ndjson,.json,.gz,application/jsonl", "data-testid": "concept-dataset" }),
    role: h("select", { name: "role", "data-testid": "concept-role" },
      h("option", { value: "" }, "target (or as stored)"), h("option", { value: "target" }, "target"), h("option", { value: "reference" }, "reference")),
    template: h("select", { name: "template" }, h("option", { value: "" }, "none"), h("option", { value: "chat" }, "chat")),
    description: h("input", { name: "description", placeholder: "what the records are", size: 30 }),
    labels: h("input", { name: "labels", placeholder: "ticket=T-42", size: 20, "data-testid": "concept-labels" }),
    reason: h("input", { name: "reason", placeholder: "a deletion request, a ticket", size: 30, "data-testid": "concept-reason" }),
  };
}

/** The multipart body the README's curl sends: -F name=… -F models=… -F dataset=@file (and the optional fields). */
function formBody(f) {
  const name = f.name.value.trim();
  const models = chosen(f.models);
  const file = f.dataset.files[0];
  if (!name) throw new Error("name the concept");
  if (!models.length) throw new Error("choose at least one model to collect on");
  if (!file) throw new Error("choose a JSONL file (one record per line)");
  const labels = parseLabels(f.labels.value);
  const form = new FormData();
  form.append("name", name);
  for (const modelId of models) form.append("models", modelId);
  for (const key of ["role", "template", "description", "reason"]) {
    if (f[key].value.trim()) form.append(key, f[key].value.trim());
  }
  if (labels) form.append("labels", JSON.stringify(labels));
  form.append("dataset", file, file.name);
  return form;
}

/** The add form: POST /concepts, then each collection job followed live until it ends. */
function addForm(models, afterChange, page) {
  const f = formInputs(models);
  const outcome = h("div", { "data-testid": "concept-outcome" });
  const submit = async () => {
    fill(outcome);
    let form;
    try { form = formBody(f); } catch (error) { fill(outcome, problemBox(error)); return; }
    let submission;
    try { submission = (await request("POST", "/concepts", { form })).data; } catch (error) { fill(outcome, problemBox(error)); return; }
    const lines = submission.jobs.map((job) => h("div", { class: "job-row" }, jobLine(job)));
    fill(outcome, h("p", {}, "Collecting ", link(conceptHref(submission.concept.name), submission.concept.name), ":"), lines);
    f.name.value = "";
    f.dataset.value = "";
    await afterChange();
    // Followed without holding the button: another concept can be added while this one collects.
    Promise.all(submission.jobs.map((job, i) =>
      followJob(job.job_id, (j) => fill(lines[i], jobLine(j)), { intervalMs: POLL_MS, alive: () => page.alive() })))
      .then(() => page.alive() && afterChange())
      .catch((error) => fill(outcome, problemBox(error)));
  };
  return section("Add a concept",
    h("p", { class: "muted" }, "A JSONL file, one record per line: {\"text\"}, {\"prompt\", \"completion\"}, {\"messages\"} or {\"image\", \"label\"}."),
    models.length ? null : h("p", { class: "warning" }, "No model is registered yet: register one on the Models page first."),
    h("div", { class: "toolbar" }, field("name", f.name), field("models", f.models), field("dataset (JSONL)", f.dataset), field("role", f.role)),
    h("div", { class: "toolbar" }, field("template", f.template), field("description", f.description), field("labels", f.labels), field("reason", f.reason),
      actionButton("Add concept", "write", submit, { testid: "concept-submit" })),
    outcome);
}

async function conceptList(view, _params, _query, page) {
  let busy = false;
  const list = pagedTable("/concepts", {}, CONCEPT_COLUMNS, {
    testid: "concepts", rowId: (c) => c.name, empty: "No concept yet.", onItems: (items) => { busy = items.some(collecting); },
  });
  const models = await all("/models");
  fill(view, h("h1", {}, "Concepts"), addForm(models, list.reload, page), section("Concepts", list.node));
  await list.reload();
  // Collections change the badges: the list is read again while one is under way.
  page.every(POLL_MS, async () => { if (busy) { try { await list.reload(); } catch { /* next tick */ } } });
}

/** What the concept's data is: uploaded or inline records, a dataset reference, or texts a model drew. */
function dataKind(concept) {
  if (concept.samples) return `texts sampled by the model (${concept.samples.count} × ${concept.samples.max_new_tokens} tokens)`;
  if (concept.dataset) return `dataset reference (${concept.dataset.format || "by extension"}), ${concept.dataset.status}`;
  return "records (uploaded or inline)";
}

function dataCard(concept) {
  return section("Data", kv([
    ["name", h("span", { "data-testid": "concept-name-shown" }, concept.name)], ["role", concept.role],
    ["kind", dataKind(concept)],
    concept.dataset ? ["reference", h("span", { class: "mono" }, concept.dataset.uri)] : null,
    concept.dataset && concept.dataset.error ? ["reference error", concept.dataset.error] : null,
    ["records", h("span", { "data-testid": "concept-records" }, fmtNum(concept.num_records))],
    ["dataset sha256", h("span", { class: "mono", "data-testid": "concept-digest" }, concept.dataset_digest || "not resolved yet")],
    ["template", concept.template || "none"], ["description", concept.description],
    ["created", fmtTime(concept.created_at)], ["created by", concept.created_by],
    ["labels", labelTags(concept.labels)], ["reason", concept.reason],
  ]));
}

function truncation(state) {
  const t = state.truncation;
  if (!t) return "—";
  return `${t.records} read, ${t.truncated.records} cut at ${t.truncated.max_length} tokens, ${t.uncounted.records} without a counted token`;
}

/** One row per model: its state, tokens, what max_length did, and the collection job (live). */
function statisticsTable(concept, jobs) {
  const rows = Object.entries(concept.models).map(([modelId, state]) => ({ modelId, state, job: jobs[state.job_id] }));
  return table([
    { label: "model", value: (r) => link(modelHref(r.modelId), r.modelId) },
    { label: "status", value: (r) => stateCell(r.state) },
    { label: "records", value: (r) => truncation(r.state) },
    { label: "collection job", value: (r) => (r.job ? jobLine(r.job) : r.state.job_id ? link(`#/jobs/${encodeURIComponent(r.state.job_id)}`, r.state.job_id) : "—") },
    { label: "error", value: (r) => (r.job && r.job.error ? h("span", { class: "problem" }, r.job.error.detail || r.job.error.title) : "") },
  ], rows, { testid: "concept-statistics", rowId: (r) => r.modelId, empty: "Not collected on any model." });
}

/** The map of this concept on each model where its statistics are ready, drawn on request. */
function mapsCard(concept, page) {
  const ready = Object.entries(concept.models).filter(([, s]) => s.status === "ready").map(([m]) => m);
  if (!ready.length) return section("Engram maps", h("p", { class: "muted" }, "Once the statistics are ready on a model, its map can be drawn here."));
  return section("Engram maps", ready.map((modelId) => {
    const target = h("div", { class: "map-holder" });
    const draw = h("button", { type: "button", "data-testid": "draw-concept-map", "data-model": modelId }, `Draw on ${modelId}`);
    draw.addEventListener("click", async () => {
      draw.disabled = true;
      try { await drawMap(target, modelId, [concept.name], () => page.alive(), "concept-map"); } finally { draw.disabled = false; }
    });
    return h("div", { class: "concept-map" }, h("div", { class: "toolbar" }, draw), target);
  }));
}

function deleteBox(name) {
  const outcome = h("div", { "data-testid": "delete-outcome" });
  const button = actionButton("Delete concept", "write", async () => {
    fill(outcome);
    if (!confirmed(`Delete the concept ${name}, its statistics and its dataset?`)) return;
    try {
      await request("DELETE", `/concepts/${encodeURIComponent(name)}`);
      window.location.hash = "#/concepts";
    } catch (error) { fill(outcome, refusal(error)); }
  }, { kind: "danger", testid: "delete-concept" });
  return h("div", { class: "delete-box" }, button, outcome);
}

/** The jobs of collections that are under way or failed (the ready ones need no more than a link). */
async function liveJobs(concept) {
  const wanted = Object.values(concept.models).filter((s) => s.job_id && s.status !== "ready").map((s) => s.job_id);
  const jobs = await Promise.all(wanted.map((id) => get(`/jobs/${encodeURIComponent(id)}`).catch(() => null)));
  return Object.fromEntries(jobs.filter(Boolean).map((j) => [j.job_id, j]));
}

async function conceptDetail(view, { name }, _query, page) {
  const path = `/concepts/${encodeURIComponent(name)}`;
  let concept = await get(path);
  const data = h("div", {});
  const statistics = h("div", {});
  const maps = h("div", {});
  const render = async () => {
    const jobs = await liveJobs(concept);
    fill(data, dataCard(concept));
    fill(statistics, section("Statistics per model", statisticsTable(concept, jobs)));
    fill(maps, mapsCard(concept, page));
  };
  fill(view, h("div", { class: "page-head" }, h("h1", {}, `Concept ${name}`), deleteBox(name)), data, statistics, maps);
  await render();
  // While a collection runs, its progress and then its state change: read both again until it ends.
  page.every(POLL_MS, async () => {
    if (!collecting(concept)) return;
    try { concept = await get(path); await render(); } catch { /* the next tick tries again */ }
  });
}

export const routes = { concepts: conceptList, "concepts/:name": conceptDetail };
