// Variants: the list (GET /variants with its own filters, paged by X-Next-Cursor), one variant's detail
// (variant_detail.js) and several side by side (compare.js). Filters live in the hash's query, so a
// filtered list is a link.
import { all, get, page as listPage } from "../api.js";
import { badge, fill, fmtTime, h, link, problemBox, table } from "../ui.js";
import { compareRoute } from "./compare.js";
import { variantDetail } from "./variant_detail.js";
import { labelsText, strengthText, termsText, variantHref } from "./variant_common.js";

const PAGE_SIZE = 50;

/** The datetime-local value of the hash as the route's ISO 8601 (the browser's zone made explicit). */
function isoTime(local) {
  if (!local) return null;
  const date = new Date(local);
  return Number.isNaN(date.getTime()) ? local : date.toISOString();
}

/** "a:b, c:d" (or one per space) -> ["a:b", "c:d"]: the route takes `label` repeated, every pair matching. */
export function labelPairs(text) {
  return (text || "").split(/[,\s]+/).map((s) => s.trim()).filter(Boolean);
}

function routeQuery(query) {
  return {
    model_id: query.model_id || null,
    concept: query.concept || null,
    label: labelPairs(query.label),
    created_by: query.created_by || null,
    created_after: isoTime(query.created_after),
    created_before: isoTime(query.created_before),
  };
}

async function choices(path, field) {
  try { return (await all(path, {}, 1000)).map((item) => item[field]); } catch { return []; }
}

function filterForm(query, models, concepts) {
  const input = (name, label, props = {}) => h("label", {}, label, h("input", { name, value: query[name] || "", "data-testid": `filter-${name}`, ...props }));
  const form = h("form", { class: "toolbar", "data-testid": "variant-filters" },
    input("model_id", "model", { list: "variant-models", placeholder: "any" }),
    h("datalist", { id: "variant-models" }, models.map((m) => h("option", { value: m }))),
    input("concept", "concept", { list: "variant-concepts", placeholder: "any" }),
    h("datalist", { id: "variant-concepts" }, concepts.map((c) => h("option", { value: c }))),
    input("label", "labels (key:value, …)", { placeholder: "team:nlp, run:3" }),
    input("created_by", "creator key", { placeholder: "key-…" }),
    input("created_after", "created at or after", { type: "datetime-local", step: "1" }),
    input("created_before", "created before", { type: "datetime-local", step: "1" }),
    h("button", { type: "submit", "data-testid": "apply-filters" }, "Filter"),
    h("a", { href: "#/variants", class: "clear" }, "clear"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = new URLSearchParams([...new FormData(form)].filter(([, v]) => String(v).trim()));
    if (query.limit) chosen.set("limit", query.limit);
    window.location.hash = `#/variants?${chosen}`;
  });
  return form;
}

function variantsTable(items, selected, onSelect) {
  const box = (v) => {
    const input = h("input", { type: "checkbox", "data-testid": "select-variant", value: v.variant_id, checked: selected.has(v.variant_id) });
    input.addEventListener("change", () => onSelect(v.variant_id, input.checked));
    return input;
  };
  return table([
    { label: "", value: box },
    { label: "variant", value: (v) => h("a", { href: variantHref(v.variant_id), class: "mono" }, v.variant_id) },
    { label: "model", value: (v) => link(`#/models/${encodeURIComponent(v.model_id)}`, v.model_id) },
    { label: "concepts", value: termsText },
    { label: "α / coefficients", value: strengthText },
    { label: "status", value: (v) => badge(v.status) },
    { label: "labels", value: (v) => h("span", { class: "labels" }, labelsText(v.labels)) },
    { label: "reason", value: (v) => v.reason || "" },
    { label: "created", value: (v) => fmtTime(v.created_at) },
    { label: "creator key", value: (v) => h("code", {}, v.created_by || "—") },
  ], items, { testid: "variants", rowId: (v) => v.variant_id, empty: "No variants match." });
}

async function variantList(view, _params, query, page) {
  const limit = Math.max(1, Math.min(1000, Number(query.limit) || PAGE_SIZE));
  const [models, concepts] = await Promise.all([choices("/models", "model_id"), choices("/concepts", "name")]);
  const items = [];
  const selected = new Set();
  let cursor = null;
  const body = h("div", {});
  const more = h("div", {});
  const compare = h("button", { type: "button", "data-testid": "compare-selected", disabled: true }, "Compare selected");
  compare.addEventListener("click", () => { window.location.hash = `#/compare?ids=${[...selected].map(encodeURIComponent).join(",")}`; });
  const onSelect = (id, on) => {
    if (on) selected.add(id); else selected.delete(id);
    compare.disabled = selected.size < 2;
    compare.textContent = selected.size ? `Compare selected (${selected.size})` : "Compare selected";
  };
  const load = async () => {
    try {
      const got = await listPage("/variants", { ...routeQuery(query), limit, cursor });
      items.push(...got.items);
      cursor = got.next;
      fill(body, variantsTable(items, selected, onSelect));
      fill(more, cursor ? h("button", { type: "button", class: "secondary", "data-testid": "load-more", onclick: load }, "Load more") : null,
        h("span", { class: "muted", "data-testid": "variant-count" }, `${items.length} shown${cursor ? ", more to load" : ""}`));
    } catch (error) {
      fill(more, problemBox(error));
    }
  };
  // A variant still building is read again until it is ready or failed: its status stays live.
  const refreshBuilding = async () => {
    const building = items.filter((v) => v.status === "building");
    if (!building.length) return;
    for (const v of building) Object.assign(v, await get(`/variants/${encodeURIComponent(v.variant_id)}`));
    fill(body, variantsTable(items, selected, onSelect));
  };
  fill(view, h("h1", {}, "Variants"), filterForm(query, models, concepts),
    h("section", { class: "card" }, h("div", { class: "toolbar" }, compare,
      h("span", { class: "muted" }, "tick two or more to see them side by side")), body, h("div", { class: "toolbar more" }, more)));
  await load();
  page.every(2000, () => refreshBuilding().catch(() => {}));
}

export const routes = { variants: variantList, "variants/:id": variantDetail, compare: compareRoute };
