// Models: the registered checkpoints (paged) with a form that registers one, and each model's page:
// its identity, concepts, universes and their storage, variants, engram map, layers, an unlearn form
// and its deletion. Every action is one documented request (POST /models, POST .../unlearn, DELETE).
import { all, followJob, get, request } from "../api.js";
import { actionButton, badge, confirmed, fill, fmtBytes, fmtNum, fmtTime, h, kv, link, problemBox, section, table } from "../ui.js";
import { collecting, drawMap, jobLine, labelTags, modelPath, pagedTable, parseLabels, refusal, stateCell } from "./mc_common.js";
import { unlearnForm } from "./models_unlearn.js";

// No wait: the register job's progress shows at once (hashing a large checkpoint takes minutes), and
// a small one's job ends within a poll or two.
const REGISTER_WAIT_S = 0;

export function modelHref(modelId) { return `#/models/${encodeURIComponent(modelId)}`; }

function field(label, input) { return h("label", {}, label, input); }

/** The register form: POST /models?wait=, then the register job followed until the model exists. */
function registerForm(page) {
  const id = h("input", { name: "model_id", required: true, placeholder: "demo/tiny-llama", "data-testid": "register-id", size: 28 });
  const source = h("input", { name: "source", required: true, placeholder: "file:///models/demo/model, s3://bucket/prefix, hf://org/name", "data-testid": "register-source", size: 52 });
  const labels = h("input", { name: "labels", placeholder: "ticket=T-42, owner=ml", "data-testid": "register-labels", size: 28 });
  const reason = h("input", { name: "reason", placeholder: "why it is registered", "data-testid": "register-reason", size: 36 });
  const outcome = h("div", { class: "form-outcome", "data-testid": "register-outcome" });
  const submit = async () => {
    fill(outcome);
    let body;
    try {
      body = { model_id: id.value.trim(), source: source.value.trim(), labels: parseLabels(labels.value) ?? undefined, reason: reason.value.trim() || undefined };
    } catch (error) { fill(outcome, problemBox(error)); return; }
    try {
      const answer = await request("POST", "/models", { json: body, query: { wait: REGISTER_WAIT_S } });
      if (answer.status === 202) await followRegistration(answer.data, outcome, page);
      else window.location.hash = modelHref(answer.data.model_id);
    } catch (error) { fill(outcome, problemBox(error)); }
  };
  return section("Register a model",
    h("p", { class: "muted" }, "A checkpoint folder inside ENGRAM_MODEL_ROOTS (file://), an s3:// prefix or a hub name (hf://)."),
    h("div", { class: "toolbar" }, field("model ID", id), field("source", source), field("labels", labels), field("reason", reason),
      actionButton("Register", "write", submit, { testid: "register-submit" })),
    outcome);
}

async function followRegistration(job, outcome, page) {
  const done = await followJob(job.job_id, (j) => fill(outcome, h("p", {}, "Registering: "), jobLine(j)), { alive: () => page.alive() });
  if (!page.alive()) return;
  if (done.status === "succeeded") window.location.hash = modelHref(done.model_id);
  else fill(outcome, h("div", { class: "problem", "data-testid": "problem" }, (done.error && done.error.detail) || `the register job ${done.status}`));
}

const MODEL_COLUMNS = [
  { label: "model", value: (m) => link(modelHref(m.model_id), m.model_id) },
  { label: "source", value: (m) => h("span", { class: "mono" }, m.source) },
  { label: "architecture", value: (m) => m.architecture },
  { label: "layers", value: (m) => String(m.layers.length), num: true },
  { label: "labels", value: (m) => labelTags(m.labels) },
  { label: "created", value: (m) => fmtTime(m.created_at) },
];

async function modelList(view, _params, _query, page) {
  const list = pagedTable("/models", {}, MODEL_COLUMNS, { testid: "models", rowId: (m) => m.model_id, empty: "No model registered yet." });
  fill(view, h("h1", {}, "Models"), registerForm(page), section("Registered models", list.node));
  await list.reload();
}

function identity(model) {
  return kv([
    ["model ID", h("span", { "data-testid": "model-id" }, model.model_id)],
    ["source", h("span", { class: "mono" }, model.source)],
    ["digest", h("span", { class: "mono", "data-testid": "model-digest" }, model.digest)],
    ["architecture", model.architecture], ["kind", model.kind],
    ["parameters", fmtNum(model.num_parameters)],
    model.quantization ? ["registered from", `GGUF ${model.quantization}`] : null,
    ["editable layers", String(model.layers.length)],
    ["created", fmtTime(model.created_at)], ["created by", model.created_by],
    ["labels", labelTags(model.labels)], ["reason", model.reason],
  ]);
}

/** The editable layers, with a filter on the name (a large model has hundreds). */
function layersCard(model) {
  const holder = h("div", {});
  const filter = h("input", { type: "search", placeholder: "filter by name (e.g. mlp)", "data-testid": "layer-filter" });
  const render = () => fill(holder, table([
    { label: "layer", value: (l) => h("span", { class: "mono" }, l.name) },
    { label: "in", value: (l) => String(l.in_features), num: true },
    { label: "out", value: (l) => String(l.out_features), num: true },
    { label: "bias", value: (l) => (l.bias ? "yes" : "no") },
    { label: "kind", value: (l) => (l.kernel ? l.kernel.kind : "linear") },
  ], model.layers.filter((l) => l.name.includes(filter.value.trim())), { testid: "layers", rowId: (l) => l.name, empty: "No layer matches." }));
  filter.addEventListener("input", render);
  render();
  const refused = Object.entries(model.refused_layers || {});
  return section(`Editable layers (${model.layers.length})`, h("div", { class: "toolbar" }, filter), holder,
    model.layers_not_in_checkpoint.length ? h("p", { class: "warning" }, `Not in the checkpoint, never edited: ${model.layers_not_in_checkpoint.join(", ")}`) : null,
    refused.length ? h("p", { class: "warning" }, `Not edited: ${refused.map(([n, why]) => `${n} (${why})`).join("; ")}`) : null);
}

function conceptsTable(modelId, concepts) {
  return table([
    { label: "concept", value: (c) => link(`#/concepts/${encodeURIComponent(c.name)}`, c.name) },
    { label: "role", value: (c) => c.role },
    { label: "statistics", value: (c) => stateCell(c.models[modelId]) },
    { label: "records", value: (c) => fmtNum(c.num_records), num: true },
    { label: "collection job", value: (c) => (c.models[modelId].job_id ? link(`#/jobs/${encodeURIComponent(c.models[modelId].job_id)}`, c.models[modelId].job_id) : "—") },
  ], concepts, { testid: "model-concepts", rowId: (c) => c.name, empty: "No concept is collected on this model yet: add one on the Concepts page." });
}

function universesCard(modelId) {
  const holder = h("div", {}, h("p", { class: "muted" }, "Loading…"));
  const load = async () => {
    try {
      const [universes, usage] = await Promise.all([all(`/models/${modelPath(modelId)}/universes`), get("/universes/usage", { model_id: modelId })]);
      fill(holder, table([
        { label: "universe", value: (u) => h("span", { class: "mono" }, u.universe_id) },
        { label: "current", value: (u) => (u.current ? "current" : "") },
        { label: "status", value: (u) => badge(u.status) },
        { label: "members", value: (u) => u.members.map((m) => m.name).join(", ") },
        { label: "groups", value: (u) => `${u.groups.done}/${u.groups.total ?? "?"}`, num: true },
        { label: "bytes", value: (u) => fmtBytes(u.bytes), num: true },
        { label: "last used", value: (u) => fmtTime(u.last_used) },
      ], universes, { testid: "universes", rowId: (u) => u.universe_id, empty: "No universe yet: the first edit builds one." }),
      storage(usage));
    } catch (error) { fill(holder, problemBox(error)); }
  };
  return { node: section("Universes and storage", holder), load };
}

function storage(usage) {
  const counts = Object.entries(usage.universes).filter(([, n]) => n).map(([s, n]) => `${n} ${s}`).join(", ") || "none";
  return h("div", { class: "storage", "data-testid": "universe-storage" }, kv([
    ["stored", `${fmtBytes(usage.bytes.total)} (factors ${fmtBytes(usage.bytes.groups)}, engrams ${fmtBytes(usage.bytes.engrams)})`],
    ["reserved by builds", fmtBytes(usage.reserved_bytes)],
    ["evictable now", fmtBytes(usage.evictable_bytes)],
    ["budget", usage.budget_bytes ? fmtBytes(usage.budget_bytes) : "no limit"],
    usage.budget_note ? ["budget note", usage.budget_note] : null,
    ["retention", `${fmtNum(usage.retention_s / 3600, 1)} h unused`],
    ["universes", counts],
  ]));
}

const VARIANT_COLUMNS = [
  { label: "variant", value: (v) => link(`#/variants/${encodeURIComponent(v.variant_id)}`, v.variant_id) },
  { label: "status", value: (v) => badge(v.status) },
  { label: "terms", value: (v) => Object.entries(v.terms).map(([c, x]) => `${c}: ${fmtNum(x)}`).join(", ") },
  { label: "alpha", value: (v) => fmtNum(v.alpha), num: true },
  { label: "scaling", value: (v) => v.scaling },
  { label: "format", value: (v) => v.format },
  { label: "created", value: (v) => fmtTime(v.created_at) },
];

/** The map card: the ready concepts as checkboxes, drawn on request (a write key's GET computes it). */
function mapCard(modelId, page) {
  const boxes = h("div", { class: "concept-choices", "data-testid": "map-concepts" });
  const target = h("div", { class: "map-holder" });
  const draw = h("button", { type: "button", "data-testid": "draw-map" }, "Draw the map");
  draw.addEventListener("click", async () => {
    draw.disabled = true;
    const concepts = [...boxes.querySelectorAll("input:checked")].map((b) => b.value);
    try { await drawMap(target, modelId, concepts, () => page.alive()); } finally { draw.disabled = false; }
  });
  const setConcepts = (ready) => fill(boxes, ready.length ? ready.map((c) => h("label", { class: "check" },
    h("input", { type: "checkbox", value: c.name, checked: c.role === "target" }), c.name)) : h("span", { class: "muted" }, "No concept is ready on this model."));
  return { node: section("Engram map", h("p", { class: "muted" }, "Where each concept's engram lives, by block and module type (computed once, then stored)."),
    h("div", { class: "toolbar" }, boxes, draw), target), setConcepts };
}

/** Delete, with the cascade option; a refusal (409) stays on the page with what it names. */
function deleteBox(modelId) {
  const cascade = h("input", { type: "checkbox", "data-testid": "delete-cascade" });
  const outcome = h("div", { "data-testid": "delete-outcome" });
  const button = actionButton("Delete model", "write", async () => {
    fill(outcome);
    if (!confirmed(`Delete ${modelId}${cascade.checked ? " with its universes and calibrations" : ""}?`)) return;
    try {
      await request("DELETE", `/models/${modelPath(modelId)}`, { query: { cascade: cascade.checked || null } });
      window.location.hash = "#/models";
    } catch (error) { fill(outcome, refusal(error)); }
  }, { kind: "danger", testid: "delete-model" });
  return h("div", { class: "delete-box" }, h("div", { class: "toolbar" }, h("label", { class: "check" }, cascade, "with its universes and calibrations"), button), outcome);
}

function readySet(concepts, modelId) {
  return concepts.filter((c) => c.models[modelId] && c.models[modelId].status === "ready");
}

/** The model's concepts (those collected on it), redrawn only when they changed; the ready ones feed the forms. */
function conceptsCard(id, forms) {
  const node = h("div", {}, h("p", { class: "muted" }, "Loading…"));
  let shown = null;
  let readyNames = null;
  const refresh = async () => {
    const mine = (await all("/concepts")).filter((c) => c.models[id]);
    const text = JSON.stringify(mine);
    if (text !== shown) { shown = text; fill(node, conceptsTable(id, mine)); }
    const ready = readySet(mine, id);
    const names = ready.map((c) => c.name).join("\n");
    if (names !== readyNames) { readyNames = names; forms.forEach((form) => form.setConcepts(ready)); }
    return mine.some(collecting);
  };
  return { node: section("Concepts", node), refresh };
}

async function modelDetail(view, { id }, _query, page) {
  const model = await get(`/models/${modelPath(id)}`);
  const universes = universesCard(id);
  const map = mapCard(id, page);
  const unlearn = unlearnForm(id, page);
  const concepts = conceptsCard(id, [map, unlearn]);
  let building = false;
  const variants = pagedTable(`/models/${modelPath(id)}/variants`, {}, VARIANT_COLUMNS, {
    testid: "model-variants", rowId: (v) => v.variant_id, empty: "No variant of this model yet.", limit: 25,
    onItems: (items) => { building = items.some((v) => v.status === "building"); },
  });
  fill(view, h("div", { class: "page-head" }, h("h1", {}, `Model ${id}`), deleteBox(id)),
    h("div", { class: "grid2" }, section("Identity", identity(model)), concepts.node),
    unlearn.node, map.node, universes.node, section("Variants", variants.node), layersCard(model));
  let collectingNow = (await Promise.all([concepts.refresh(), universes.load(), variants.reload()]))[0];
  // While collections or builds are under way, what they change is read again until the user leaves.
  page.every(3000, async () => {
    try {
      if (collectingNow) collectingNow = await concepts.refresh();
      if (building) { await variants.reload(); await universes.load(); }
    } catch { /* the next tick tries again */ }
  });
}

export const routes = {
  models: modelList,
  "models/:id": modelDetail,
  // A typed #/models/org/name (the ID's slash not encoded) is the same page.
  "models/:org/:name": (view, { org, name }, query, page) => modelDetail(view, { id: `${org}/${name}` }, query, page),
};
