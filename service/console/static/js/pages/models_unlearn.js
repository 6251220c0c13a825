// The model page's "Unlearn" form: one POST /models/{id}/unlearn with the UnlearnRequest's fields
// (api_schemas/variants.py, edit_options.py). Left empty, a field is left out and the service's
// default applies (alpha: the last calibration's recommendation or a conservative 0.25, said in
// the answer's warnings). On success the console opens the variant's page.
import { all, post } from "../api.js";
import { actionButton, fill, h, problemBox, section } from "../ui.js";
import { chosen, csv, modelPath, parseLabels } from "./mc_common.js";

const SCALINGS = ["uniform", "weight_norm"];
const FORMATS = ["checkpoint", "delta", "peft", "gguf"];
const GGUF_TYPES = ["", "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"];
const WARNING_MS = 20_000; // warnings outlive the navigation to the variant: long enough to read

function field(label, input, hint) { return h("label", { title: hint || null }, label, input); }
function options(values, selected) { return values.map((v) => h("option", { value: v, selected: v === selected }, v || "default")); }

/** A number typed in a field, or undefined when it is empty (the API's default). */
function number(input) {
  const text = input.value.trim();
  if (!text) return undefined;
  const value = Number(text);
  if (!Number.isFinite(value)) throw new Error(`${input.name} must be a number, not "${text}"`);
  return value;
}

/** "q_proj=0.5, mlp.down_proj=2" as {suffix: strength}. */
function strengths(text) {
  const pairs = parseLabels(text);
  if (!pairs) return undefined;
  return Object.fromEntries(Object.entries(pairs).map(([k, v]) => [k, Number(v)]));
}

/** Each warning the answer carries, kept on screen after the page changes to the variant. */
function showWarnings(warnings) {
  const holder = document.getElementById("toasts");
  for (const text of warnings) {
    const node = h("div", { class: "toast warning", role: "status", "data-testid": "unlearn-warning" }, text);
    holder.append(node);
    setTimeout(() => node.remove(), WARNING_MS);
  }
}

function inputs() {
  return {
    concepts: h("select", { name: "concepts", multiple: true, size: 4, "data-testid": "unlearn-concepts" }),
    alpha: h("input", { name: "alpha", type: "number", step: "any", min: "0", max: "100", placeholder: "service's choice", "data-testid": "unlearn-alpha" }),
    scaling: h("select", { name: "scaling", "data-testid": "unlearn-scaling" }, options(SCALINGS, "uniform")),
    format: h("select", { name: "format", "data-testid": "unlearn-format" }, options(FORMATS, "checkpoint")),
    modules: h("input", { name: "modules", placeholder: "gate_proj, up_proj, down_proj", size: 30 }),
    layers: h("input", { name: "layers", placeholder: "0, 1, 2", size: 12 }),
    module_strengths: h("input", { name: "module_strengths", placeholder: "q_proj=0.5", size: 20 }),
    rcond: h("input", { name: "rcond", type: "number", step: "any", placeholder: "D·eps32" }),
    universe: h("select", { name: "universe", "data-testid": "unlearn-universe" }, h("option", { value: "" }, "the model's current one")),
    reference: h("input", { name: "reference", placeholder: "retain, general", size: 20 }),
    lora_rank: h("input", { name: "lora_rank", type: "number", step: "1", min: "1", placeholder: "exact" }),
    lora_target: h("select", { name: "lora_target" }, options(["peft", "vllm"], "peft")),
    gguf_quantization: h("select", { name: "gguf_quantization" }, options(GGUF_TYPES, "")),
    labels: h("input", { name: "labels", placeholder: "ticket=T-42", size: 20, "data-testid": "unlearn-labels" }),
    reason: h("input", { name: "reason", placeholder: "a deletion request, a ticket", size: 36, "data-testid": "unlearn-reason" }),
  };
}

/** The request body; a field left empty is left out. Throws an Error naming a field it cannot read. */
function body(f) {
  const layers = csv(f.layers.value);
  const request = {
    concepts: chosen(f.concepts),
    alpha: number(f.alpha),
    scaling: f.scaling.value,
    format: f.format.value,
    modules: csv(f.modules.value) ?? undefined,
    layers: layers ? layers.map(Number) : undefined,
    module_strengths: strengths(f.module_strengths.value),
    rcond: number(f.rcond),
    universe: f.universe.value || undefined,
    reference: csv(f.reference.value) ?? undefined,
    labels: parseLabels(f.labels.value) ?? undefined,
    reason: f.reason.value.trim() || undefined,
  };
  if (request.format === "peft") Object.assign(request, { lora_rank: number(f.lora_rank), lora_target: f.lora_target.value });
  if (request.format === "gguf" && f.gguf_quantization.value) request.gguf_quantization = f.gguf_quantization.value;
  if (!request.concepts.length) throw new Error("choose at least one ready concept to unlearn");
  return request;
}

/** {node, setConcepts(ready)}: the form, and how the page gives it the model's ready concepts. */
export function unlearnForm(modelId, page) {
  const f = inputs();
  const outcome = h("div", { "data-testid": "unlearn-outcome" });
  const submit = async () => {
    fill(outcome);
    let request;
    try { request = body(f); } catch (error) { fill(outcome, problemBox(error)); return; }
    try {
      const answer = await post(`/models/${modelPath(modelId)}/unlearn`, request);
      showWarnings(answer.warnings || []);
      if (page.alive()) window.location.hash = `#/variants/${encodeURIComponent(answer.variant.variant_id)}`;
    } catch (error) { fill(outcome, problemBox(error)); }
  };
  all(`/models/${modelPath(modelId)}/universes`).then((universes) => f.universe.append(...universes.map((u) =>
    h("option", { value: u.universe_id }, `${u.universe_id.slice(0, 12)}… (${u.members.map((m) => m.name).join(", ")})${u.current ? " · current" : ""}`))),
  () => { /* the universes card shows the problem */ });
  const more = h("details", { class: "more-options" }, h("summary", {}, "More options"),
    h("div", { class: "toolbar" }, field("modules", f.modules, "module-name suffixes"), field("layers", f.layers, "block indices"),
      field("module strengths", f.module_strengths, "suffix=factor, 0 < factor ≤ 4"), field("rcond", f.rcond, "keep λ > rcond·λmax"),
      field("universe", f.universe), field("reference", f.reference, "concepts of the universe besides these")),
    h("div", { class: "toolbar" }, field("LoRA rank (peft)", f.lora_rank), field("LoRA target (peft)", f.lora_target),
      field("GGUF type (gguf)", f.gguf_quantization)));
  const node = section("Unlearn",
    h("p", { class: "muted" }, "W_new = W − α Σ f_l W_k⁺ over the chosen concepts. Without α the service chooses one and says why."),
    h("div", { class: "toolbar" }, field("concepts (ready)", f.concepts), field("alpha", f.alpha), field("scaling", f.scaling), field("format", f.format),
      field("labels", f.labels), field("reason", f.reason)),
    more,
    h("div", { class: "toolbar" }, actionButton("Unlearn", "write", submit, { testid: "unlearn-submit" })),
    outcome);
  const setConcepts = (ready) => {
    const keep = new Set(chosen(f.concepts));
    fill(f.concepts, ready.map((c) => h("option", { value: c.name, selected: keep.has(c.name) }, `${c.name} (${c.role})`)));
  };
  return { node, setConcepts };
}
