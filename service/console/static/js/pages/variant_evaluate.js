// The Evaluate form: forget and retain probe files (JSONL, read in the browser), optional attacks, one
// POST /variants/{id}/evaluate (EvaluateRequest in api_schemas/evaluation.py), then the job followed
// live and its result shown with the same tables as the stored evaluations.
import { ApiError, followJob, request } from "../api.js";
import { actionButton, badge, fill, h, link, problemBox, progressBar } from "../ui.js";
import { evaluationBlock } from "./variant_common.js";

/**
 * The probes of a JSONL file (one JSON object a line; a JSON array is taken too). Throws an Error
 * naming the file and line of the first record that is not a JSON object.
 */
export function parseProbes(text, name) {
  const trimmed = text.trim();
  if (!trimmed) return [];
  if (trimmed.startsWith("[")) {
    let records;
    try { records = JSON.parse(trimmed); } catch (error) { throw new Error(`${name}: not a JSON array (${error.message})`); }
    records.forEach((r, i) => { if (!r || typeof r !== "object" || Array.isArray(r)) throw new Error(`${name}: item ${i} is not an object`); });
    return records;
  }
  const probes = [];
  text.split(/\r?\n/).forEach((line, i) => {
    if (!line.trim()) return;
    let record;
    try { record = JSON.parse(line); } catch (error) { throw new Error(`${name} line ${i + 1}: not JSON (${error.message})`); }
    if (!record || typeof record !== "object" || Array.isArray(record)) throw new Error(`${name} line ${i + 1}: not a JSON object`);
    probes.push(record);
  });
  return probes;
}

async function readFileInput(input, split) {
  const file = input.files && input.files[0];
  return file ? parseProbes(await file.text(), `${split} file ${file.name}`) : [];
}

/** The attacks ticked, each with the optional bound on the attacked variant's forget exact match. */
function chosenAttacks(form) {
  const bound = form.elements.max_forget_em.value.trim();
  const thresholds = bound === "" ? undefined : [{ metric: "forget_exact_match", max: Number(bound) }];
  const attacks = [];
  if (form.elements.quantize.checked) attacks.push({ kind: "quantize", type: "Q4_1", ...(thresholds ? { thresholds } : {}) });
  if (form.elements.relearn.checked) attacks.push({ kind: "relearn", ...(thresholds ? { thresholds } : {}) });
  return attacks;
}

async function buildRequest(form) {
  const forget = await readFileInput(form.elements.forget, "forget");
  const retain = await readFileInput(form.elements.retain, "retain");
  if (!forget.length && !retain.length) throw new Error("choose a forget or a retain probe file (JSONL: one {\"prompt\", \"completion\"} a line)");
  const attacks = chosenAttacks(form);
  const reason = form.elements.reason.value.trim(); // stored with the evaluation (who and when: the service's)
  return { forget, retain, ...(attacks.length ? { attacks } : {}), ...(reason ? { reason } : {}) };
}

function jobLine(job) {
  return h("div", { class: "toolbar", "data-testid": "eval-job", "data-job-id": job.job_id, "data-status": job.status },
    badge(job.status), progressBar(job), h("span", { class: "muted" }, `${job.progress.done}/${job.progress.total} ${job.progress.unit}`),
    link(`#/jobs/${encodeURIComponent(job.job_id)}`, `job ${job.job_id}`));
}

function fields() {
  const file = (name, label) => h("label", {}, label, h("input", { type: "file", name, accept: ".jsonl,.json,application/json", "data-testid": `probes-${name}` }));
  const tick = (name, label) => h("label", { class: "tick" }, h("input", { type: "checkbox", name, "data-testid": `attack-${name}` }), label);
  return [
    file("forget", "forget probes (JSONL)"), file("retain", "retain probes (JSONL)"),
    h("fieldset", { class: "attacks" }, h("legend", {}, "attacks (optional)"),
      tick("quantize", "quantize Q4_1"), tick("relearn", "relearn (10 steps on half the forget set)"),
      h("label", {}, "pass when the attacked forget exact match is at most",
        h("input", { type: "number", name: "max_forget_em", min: "0", max: "1", step: "0.01", placeholder: "no bound", "data-testid": "attack-bound" }))),
    h("label", {}, "reason (optional, kept with the evaluation)",
      h("input", { type: "text", name: "reason", maxlength: "2000", placeholder: "why it is run", "data-testid": "eval-reason" })),
  ];
}

/** The form; `onStored` runs once a job has finished (its evaluation is then in the receipt). */
export function evaluateForm(variant, page, onStored) {
  const out = h("div", { "data-testid": "eval-output" });
  const form = h("form", { class: "evaluate-form", "data-testid": "evaluate-form" }, fields());
  const submit = actionButton("Evaluate", "write", async () => {
    fill(out);
    let body;
    try { body = await buildRequest(form); } catch (error) { fill(out, problemBox(error)); return; }
    let job;
    try {
      job = (await request("POST", `/variants/${encodeURIComponent(variant.variant_id)}/evaluate`, { json: body })).data;
    } catch (error) {
      if (error instanceof ApiError) { fill(out, problemBox(error)); return; }
      throw error;
    }
    const line = h("div", {}, jobLine(job));
    fill(out, line);
    const done = await followJob(job.job_id, (j) => fill(line, jobLine(j)), { intervalMs: 1000, alive: () => page.alive() });
    if (!page.alive()) return;
    if (done.status !== "succeeded") {
      fill(out, line, h("div", { class: "problem", "data-testid": "eval-error" }, (done.error && (done.error.detail || done.error.title)) || done.status));
      return;
    }
    fill(out, line, h("div", { "data-testid": "eval-result" }, evaluationBlock(done.result, "This evaluation's result")));
    await onStored();
  }, { testid: "evaluate" });
  form.addEventListener("submit", (event) => { event.preventDefault(); submit.click(); });
  form.append(h("div", { class: "toolbar" }, submit,
    h("span", { class: "muted" }, "scores the base and the variant on every probe (a write key)")), out);
  if (variant.status !== "ready") submit.disabled = true;
  return form;
}
