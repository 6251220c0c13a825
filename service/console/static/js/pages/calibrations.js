// Calibrations: the list (GET /calibrations, live while one runs), a form that starts one
// (POST /models/{id}/calibrate) and each calibration's page (calibration_detail.js): its front as an
// interactive plot, the recommendation and its warnings, the search's cost, "build this one".
import { page as listPage } from "../api.js";
import { badge, fill, fmtNum, fmtPct, fmtTime, h, link, problemBox, section, table } from "../ui.js";
import { calibrationDetail } from "./calibration_detail.js";
import { calibrationForm } from "./calibration_form.js";

const PAGE_SIZE = 100;
const UNFINISHED = new Set(["queued", "running"]);

export function calibrationHref(id) { return `#/calibrations/${encodeURIComponent(id)}`; }
function modelHref(id) { return `#/models/${encodeURIComponent(id)}`; }
function variantHref(id) { return `#/variants/${encodeURIComponent(id)}`; }

/** The recommendation's headline in one line: α, scaling, module set, the two ratios, exact match. */
function headline(c) {
  if (c.status !== "succeeded") return h("span", { class: "muted" }, "—");
  const r = c.recommended;
  if (!r) return h("span", { class: "muted", title: c.note || "" }, "none feasible");
  const o = r.options;
  return h("span", { class: "cal-headline" },
    `α ${fmtNum(o.alpha)} · ${o.scaling} · ${o.module_set} · forget ×${fmtNum(r.forget_nll_ratio, 2)} / retain ×${fmtNum(r.retain_nll_ratio, 2)} NLL`,
    r.forget_exact_match !== null && r.forget_exact_match !== undefined ? ` · EM ${fmtPct(r.forget_exact_match)} / ${fmtPct(r.retain_exact_match)}` : "");
}

const COLUMNS = [
  { label: "calibration", value: (c) => link(calibrationHref(c.calibration_id), c.calibration_id.slice(0, 12)) },
  { label: "model", value: (c) => link(modelHref(c.model_id), c.model_id) },
  { label: "concepts", value: (c) => c.concepts.join(", ") },
  { label: "status", value: (c) => badge(c.status) },
  { label: "created", value: (c) => fmtTime(c.created_at) },
  { label: "candidates", value: (c) => (c.candidates === null || c.candidates === undefined ? "—" : String(c.candidates)), num: true },
  { label: "recommended", value: headline },
  { label: "variant", value: (c) => (c.recommended ? link(variantHref(c.recommended.variant_id), c.recommended.variant_id.slice(0, 12)) : "—") },
  { label: "warnings", value: (c) => (c.warnings ? h("span", { class: "cal-warn-count" }, String(c.warnings)) : "—"), num: true },
];

/** The list's newest first: the API pages by ID, so one page is sorted here by creation time. */
function newestFirst(items) {
  return [...items].sort((a, b) => String(b.created_at || "").localeCompare(String(a.created_at || "")));
}

function filterForm(query) {
  const form = h("form", { class: "toolbar" },
    h("label", {}, "model", h("input", { name: "model_id", value: query.model_id || "", placeholder: "any model", "data-testid": "calibrations-model-filter" })),
    h("button", { type: "submit", class: "secondary" }, "Filter"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = new URLSearchParams([...new FormData(form)].filter(([, v]) => v));
    window.location.hash = `#/calibrations${chosen.toString() ? `?${chosen}` : ""}`;
  });
  return form;
}

async function calibrationList(view, _params, query, page) {
  const body = h("div", {});
  const cursor = query.cursor || null;
  const refresh = async () => {
    try {
      const answer = await listPage("/calibrations", { model_id: query.model_id || null, cursor, limit: PAGE_SIZE });
      if (!page.alive()) return;
      const more = answer.next ? h("a", { href: `#/calibrations?${new URLSearchParams({ ...query, cursor: answer.next })}`, "data-testid": "calibrations-next" }, "Next page") : null;
      fill(body, table(COLUMNS, newestFirst(answer.items), { testid: "calibrations", rowId: (c) => c.calibration_id, empty: "No calibration yet." }), more);
      return answer.items.some((c) => UNFINISHED.has(c.status));
    } catch (error) { fill(body, problemBox(error)); return false; }
  };
  fill(view, h("h1", {}, "Calibrations"), calibrationForm(page, query.model_id), section("Calibrations", filterForm(query), body));
  await refresh();
  page.every(3000, refresh); // a running calibration's status changes here without a reload
}

export const routes = { calibrations: calibrationList, "calibrations/:id": calibrationDetail };
