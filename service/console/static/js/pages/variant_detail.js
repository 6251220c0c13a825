// One variant: its status (live while its build job runs), options, provenance, files, the evaluations
// stored for it (read from its receipt), evaluate jobs running on it, the receipt and model card, an
// Evaluate form (variant_evaluate.js) and Delete.
import { ApiError, all, del, followJob, get } from "../api.js";
import { actionButton, badge, confirmed, fill, h, kv, link, problemBox, progressBar, section, toast } from "../ui.js";
import {
  downloadJson, evaluationBlock, filesTable, modelCard, optionRows, provenanceRows, receiptOf, showValue, variantHref,
} from "./variant_common.js";
import { evaluateForm } from "./variant_evaluate.js";

function pairs(rows) {
  return kv(rows.filter(([, value]) => value !== null && value !== undefined).map(([label, value]) => [label, showValue(label, value)]));
}

function statusLine(variant, job) {
  return h("div", { class: "toolbar", "data-testid": "variant-status", "data-status": variant.status },
    badge(variant.status),
    job && variant.status === "building" ? [progressBar(job), h("span", { class: "muted" }, `${job.progress.done}/${job.progress.total} ${job.progress.unit}`)] : null,
    variant.job_id ? h("span", { class: "muted" }, "build job ", link(`#/jobs/${encodeURIComponent(variant.job_id)}`, variant.job_id)) : null);
}

function provenance(variant) {
  const rows = provenanceRows(variant).map(([label, value]) => (label === "reverts" && value
    ? [label, link(variantHref(value), value)] : [label, showValue(label, value)]));
  return kv(rows);
}

function receiptSection(variant, found) {
  if (!found.receipt) return section("Receipt", h("p", { class: "muted", "data-testid": "no-receipt" }, found.why));
  const r = found.receipt;
  const signed = r.signed ? h("span", { class: "badge ok", "data-testid": "receipt-signed" }, `signed (${r.algorithm})`)
    : h("span", { class: "badge", "data-testid": "receipt-signed", title: r.note || "" }, "unsigned");
  return section("Receipt",
    kv([
      ["signature", signed],
      ["digest", h("code", { "data-testid": "receipt-digest" }, r.digest)],
      r.signed ? null : ["why unsigned", r.note || "—"],
      ["base model digest", h("code", {}, (r.receipt.base_model || {}).digest || "—")],
    ]),
    h("div", { class: "toolbar" }, h("button", {
      type: "button", class: "secondary", "data-testid": "download-receipt",
      onclick: () => downloadJson(r, `receipt-${variant.variant_id}.json`),
    }, "Download receipt (JSON)")));
}

async function cardSection(variant) {
  if (variant.status !== "ready") return null;
  const card = h("pre", { class: "model-card", "data-testid": "model-card" }, "Loading…");
  modelCard(variant.variant_id).then((text) => { card.textContent = text; }, (error) => fill(card, problemBox(error)));
  return h("section", { class: "card" }, h("details", {}, h("summary", { "data-testid": "show-model-card" }, h("h2", {}, "Model card")), card));
}

function evaluationsSection(found) {
  const stored = found.receipt ? found.receipt.receipt.evaluations || [] : [];
  return section(`Evaluations (${stored.length} stored)`,
    h("div", { "data-testid": "stored-evaluations", "data-count": String(stored.length) },
      stored.length ? stored.map((e, i) => evaluationBlock(e, `Evaluation ${i + 1}: ${e.evaluation_id}`))
        : h("p", { class: "muted" }, found.receipt ? "None yet: run one below." : found.why)));
}

/** Evaluate jobs not finished yet on this variant (GET /jobs lists the unfinished ones by default). */
function runningEvaluations(variantId, onFinished) {
  const box = h("div", { "data-testid": "running-evaluations" });
  let seen = 0;
  const refresh = async () => {
    const jobs = (await all("/jobs", { kind: "evaluate" }, 500)).filter((j) => j.variant_id === variantId);
    if (jobs.length < seen) onFinished();
    seen = jobs.length;
    fill(box, jobs.length ? jobs.map((j) => h("div", { class: "toolbar" }, badge(j.status), progressBar(j),
      link(`#/jobs/${encodeURIComponent(j.job_id)}`, `evaluate job ${j.job_id}`))) : null);
  };
  return { box, refresh };
}

function deleteControl(variant) {
  const problem = h("div", { "data-testid": "delete-problem" });
  const button = actionButton("Delete variant", "write", async () => {
    if (!confirmed(`Delete variant ${variant.variant_id} and every file it owns? This cannot be undone.`)) return;
    fill(problem);
    try {
      await del(`/variants/${encodeURIComponent(variant.variant_id)}`);
    } catch (error) {
      // A 409 names the unfinished job that builds or reads it; a 403, the key that may delete it.
      if (error instanceof ApiError) { fill(problem, problemBox(error)); return; }
      throw error;
    }
    toast(`Deleted variant ${variant.variant_id}`);
    window.location.hash = "#/variants";
  }, { kind: "danger", testid: "delete-variant" });
  return h("div", {}, button, problem);
}

async function render(view, variant, page) {
  const found = await receiptOf(variant);
  if (!page.alive()) return;
  const evaluations = h("div", {}, evaluationsSection(found));
  const reloadEvaluations = async () => fill(evaluations, evaluationsSection(await receiptOf(variant)));
  const running = runningEvaluations(variant.variant_id, reloadEvaluations);
  const status = h("div", {}, statusLine(variant, null));
  fill(view,
    h("div", { class: "toolbar title" }, h("h1", { "data-testid": "variant-id" }, `Variant ${variant.variant_id}`), deleteControl(variant)),
    status,
    h("div", { class: "grid2" }, section("Options and terms", h("div", { "data-testid": "variant-options" }, pairs(optionRows(variant)))),
      section("Provenance", h("div", { "data-testid": "variant-provenance" }, provenance(variant)))),
    section("Files", filesTable(variant)),
    evaluations,
    section("Evaluate", running.box, evaluateForm(variant, page, reloadEvaluations)),
    receiptSection(variant, found),
    await cardSection(variant));
  await running.refresh();
  page.every(3000, () => running.refresh().catch(() => {}));
  return status;
}

/** #/variants/:id — while it builds, follow its job and show the page again once it is done. */
export async function variantDetail(view, { id }, _query, page) {
  const variant = await get(`/variants/${encodeURIComponent(id)}`);
  const status = await render(view, variant, page);
  if (variant.status !== "building" || !variant.job_id || !page.alive()) return;
  await followJob(variant.job_id, (job) => fill(status, statusLine(variant, job)), { intervalMs: 1000, alive: () => page.alive() });
  if (page.alive()) await render(view, await get(`/variants/${encodeURIComponent(id)}`), page);
}
