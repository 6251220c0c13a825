// The "New calibration" form: the request's main fields (CalibrateRequest in api_schemas/calibration.py),
// sent as one POST /models/{id}/calibrate; the calibration's page then follows its job.
import { all, request } from "../api.js";
import { actionButton, fill, h, problemBox } from "../ui.js";

const PRESETS = ["all", "qk_gate", "attention", "mlp", "data_weighted"];
const SCALINGS = ["uniform", "weight_norm"];
const FORMATS = ["checkpoint", "delta", "peft"];

function field(label, input, hint) {
  return h("label", { title: hint || null }, label, input);
}

/** JSON lines of {"prompt", "completion"} (or {"messages"}) probes; a 4xx-style message names the bad line. */
export function parseProbes(text, name) {
  const probes = [];
  text.split("\n").forEach((line, i) => {
    if (!line.trim()) return;
    let value;
    try { value = JSON.parse(line); } catch { throw new Error(`${name} probes, line ${i + 1}: not JSON (one {"prompt": …, "completion": …} per line)`); }
    if (!value || typeof value !== "object" || Array.isArray(value)) throw new Error(`${name} probes, line ${i + 1}: not a JSON object`);
    probes.push(value);
  });
  if (!probes.length) throw new Error(`${name} probes: give at least one (JSON lines, or load a .jsonl file)`);
  return probes;
}

/** A textarea of JSON-lines probes and a file input that fills it (read here: nothing leaves the page). */
function probesInput(name) {
  const area = h("textarea", { name, "data-testid": `calibrate-${name}`, placeholder: '{"prompt": "Q: …? A:", "completion": " …"}' });
  const file = h("input", { type: "file", accept: ".jsonl,.json,.txt", "data-testid": `calibrate-${name}-file` });
  file.addEventListener("change", async () => { if (file.files[0]) area.value = await file.files[0].text(); });
  return { area, node: h("div", { class: "cal-probes" }, field(`${name} probes (JSON lines)`, area), file) };
}

function checkboxes(name, values, checked) {
  return h("fieldset", { class: "cal-checks" }, h("legend", {}, name),
    values.map((v) => h("label", { class: "inline" }, h("input", { type: "checkbox", name, value: v, checked: checked.includes(v) }), v)));
}

function number(name, placeholder, attrs = {}) {
  return h("input", { name, type: "number", step: "any", placeholder, size: 8, "data-testid": `calibrate-${name}`, ...attrs });
}

function checked(form, name) { return [...form.querySelectorAll(`input[name=${name}]:checked`)].map((i) => i.value); }

function optionalNumber(input) { return input.value.trim() === "" ? undefined : Number(input.value); }

/** The request's body from the form (undefined fields are left to the service's defaults). */
function requestBody(form, inputs) {
  const modules = checked(form, "module_sets");
  return {
    concepts: [...inputs.concepts.selectedOptions].map((o) => o.value),
    forget: parseProbes(inputs.forget.area.value, "forget"),
    retain: parseProbes(inputs.retain.area.value, "retain"),
    budget: optionalNumber(inputs.budget),
    alpha_min: optionalNumber(inputs.alphaMin),
    alpha_max: optionalNumber(inputs.alphaMax),
    scalings: checked(form, "scalings"),
    module_sets: modules.length ? modules : undefined,
    max_retain_nll_ratio: optionalNumber(inputs.maxRetain),
    held_out_fraction: optionalNumber(inputs.heldOut),
    format: inputs.format.value,
  };
}

async function fillChoices(models, concepts, selectedModel) {
  const [modelItems, conceptItems] = await Promise.all([all("/models"), all("/concepts")]);
  fill(models, modelItems.map((m) => h("option", { value: m.model_id, selected: m.model_id === selectedModel }, m.model_id)));
  fill(concepts, conceptItems.map((c) => h("option", { value: c.name }, c.name)));
}

export function calibrationForm(page, selectedModel) {
  const inputs = {
    model: h("select", { name: "model", "data-testid": "calibrate-model", required: true }),
    concepts: h("select", { name: "concepts", multiple: true, size: 4, "data-testid": "calibrate-concepts" }),
    forget: probesInput("forget"),
    retain: probesInput("retain"),
    budget: number("budget", "32", { min: 1, max: 500, step: 1 }),
    alphaMin: number("alpha_min", "0.05"),
    alphaMax: number("alpha_max", "4"),
    maxRetain: number("max_retain_nll_ratio", "exact-match goal"),
    heldOut: number("held_out_fraction", "0.2"),
    format: h("select", { name: "format", "data-testid": "calibrate-format" }, FORMATS.map((f) => h("option", { value: f }, f))),
  };
  const outcome = h("div", { "data-testid": "calibrate-outcome" });
  const form = h("form", { class: "cal-form", "data-testid": "calibrate-form" },
    h("div", { class: "toolbar" }, field("model", inputs.model), field("concepts to remove", inputs.concepts)),
    h("div", { class: "cal-probe-pair" }, inputs.forget.node, inputs.retain.node),
    h("div", { class: "toolbar" }, field("budget (candidates)", inputs.budget), field("α min", inputs.alphaMin), field("α max", inputs.alphaMax),
      field("max retain NLL ratio", inputs.maxRetain, "set: the NLL-ratio search; empty: the exact-match default objective"),
      field("held-out fraction", inputs.heldOut), field("variant format", inputs.format)),
    h("div", { class: "toolbar" }, checkboxes("scalings", SCALINGS, SCALINGS), checkboxes("module_sets", PRESETS, [])),
    h("p", { class: "muted" }, "No module set ticked: every preset that selects a layer of the model."));
  const submit = async () => {
    fill(outcome);
    let body;
    try { body = requestBody(form, inputs); } catch (error) { fill(outcome, problemBox(error)); return; }
    const model = inputs.model.value;
    try {
      const answer = await request("POST", `/models/${model.split("/").map(encodeURIComponent).join("/")}/calibrate`, { json: body });
      if (page.alive()) window.location.hash = `#/calibrations/${encodeURIComponent(answer.data.calibration_id)}`;
    } catch (error) { fill(outcome, problemBox(error)); }
  };
  form.append(actionButton("Start calibration", "write", submit, { testid: "calibrate-submit" }), outcome);
  form.addEventListener("submit", (event) => event.preventDefault());
  fillChoices(inputs.model, inputs.concepts, selectedModel).catch((error) => fill(outcome, problemBox(error)));
  return h("details", { class: "card cal-new" }, h("summary", { "data-testid": "calibrate-open" }, "New calibration"), form);
}
