// Jobs: what the service is working on (live), the history of finished jobs, one job's detail.
import { all, del, followJob, get, isFinished, page as listPage } from "../api.js";
import { actionButton, badge, confirmed, fill, fmtTime, h, json, kv, link, problemBox, progressBar, table, toast } from "../ui.js";

const KINDS = ["collect", "variant", "universe", "evaluate", "generate", "calibrate", "map", "register"];
const FINISHED = ["succeeded", "failed", "cancelled"];

/** Where a job's outcome can be seen in the console. */
export function jobSubject(job) {
  if (job.kind === "calibrate" && job.result && job.result.calibration_id) {
    return link(`#/calibrations/${encodeURIComponent(job.result.calibration_id)}`, job.result.calibration_id);
  }
  if (job.variant_id) return link(`#/variants/${encodeURIComponent(job.variant_id)}`, job.variant_id);
  if (job.concept) return link(`#/concepts/${encodeURIComponent(job.concept)}`, job.concept);
  if (job.model_id) return link(`#/models/${encodeURIComponent(job.model_id)}`, job.model_id);
  return "—";
}

function cancelButton(job, after) {
  if (isFinished(job)) return null;
  return actionButton("Cancel", "admin", async () => {
    if (!confirmed(`Cancel job ${job.job_id}?`)) return;
    await del(`/jobs/${encodeURIComponent(job.job_id)}`);
    toast(`Cancelling ${job.job_id}`);
    await after();
  }, { kind: "danger", testid: "cancel-job" });
}

function jobsTable(jobs, refresh, testid) {
  return table([
    { label: "job", value: (j) => link(`#/jobs/${encodeURIComponent(j.job_id)}`, j.job_id) },
    { label: "kind", value: (j) => j.kind },
    { label: "status", value: (j) => badge(j.status) },
    { label: "for", value: jobSubject },
    { label: "progress", value: (j) => h("div", {}, progressBar(j), h("span", { class: "muted" }, `${j.progress.done}/${j.progress.total} ${j.progress.unit}`)) },
    { label: "created", value: (j) => fmtTime(j.created_at) },
    { label: "finished", value: (j) => fmtTime(j.finished_at) },
    { label: "", value: (j) => cancelButton(j, refresh) },
  ], jobs, { testid, rowId: (j) => j.job_id, empty: "No jobs." });
}

async function jobList(view, _params, query, page) {
  const kind = query.kind || "";
  const status = query.status || "";
  const active = h("div", {});
  const history = h("div", {});
  const refreshActive = async () => {
    try { fill(active, jobsTable(await all("/jobs", { kind: kind || null }), refreshActive, "active-jobs")); }
    catch (error) { fill(active, problemBox(error)); }
  };
  const filters = h("form", { class: "toolbar" },
    h("label", {}, "kind", h("select", { name: "kind" }, h("option", { value: "" }, "any"), KINDS.map((k) => h("option", { value: k, selected: k === kind }, k)))),
    h("label", {}, "finished as", h("select", { name: "status" }, h("option", { value: "" }, "any"), FINISHED.map((s) => h("option", { value: s, selected: s === status }, s)))),
    h("label", {}, "created after", h("input", { name: "created_after", type: "datetime-local", value: query.created_after || "" })),
    h("button", { type: "submit" }, "Filter"));
  filters.addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = new URLSearchParams([...new FormData(filters)].filter(([, v]) => v));
    window.location.hash = `#/jobs?${chosen}`;
  });
  fill(view, h("h1", {}, "Jobs"), filters,
    h("section", { class: "card" }, h("h2", {}, "Queued and running (live)"), active),
    h("section", { class: "card" }, h("h2", {}, "Finished"), history));
  await refreshActive();
  page.every(2000, refreshActive);
  const after = query.created_after ? new Date(query.created_after).toISOString() : null;
  const finished = await listPage("/jobs", { status: status || FINISHED, kind: kind || null, created_after: after, limit: 200 });
  // The list is oldest first: the newest history a user looks for is at its end.
  fill(history, jobsTable(finished.items.reverse(), refreshActive, "finished-jobs"),
    finished.next ? h("p", { class: "muted" }, "Older jobs than these 200: narrow the filters.") : null);
}

async function jobDetail(view, { id }, _query, page) {
  const body = h("div", {});
  const render = (job) => fill(body,
    h("div", { class: "toolbar" }, badge(job.status), progressBar(job), cancelButton(job, () => get(`/jobs/${encodeURIComponent(id)}`).then(render))),
    kv([
      ["kind", job.kind], ["for", jobSubject(job)], ["model", job.model_id], ["progress", `${job.progress.done}/${job.progress.total} ${job.progress.unit}`],
      ["created", fmtTime(job.created_at)], ["started", fmtTime(job.started_at)], ["finished", fmtTime(job.finished_at)],
    ]),
    job.error ? h("div", {}, h("h2", {}, "Error"), h("div", { class: "problem", "data-testid": "job-error" }, job.error.detail || job.error.title)) : null,
    job.result ? h("div", {}, h("h2", {}, "Result"), json(job.result)) : null);
  fill(view, h("h1", {}, `Job ${id}`), body);
  await followJob(id, render, { intervalMs: 1000, alive: () => page.alive() });
}

export const routes = { jobs: jobList, "jobs/:id": jobDetail };
