// Drives Debian's chromium through the Postal dashboard, as an operator would. Run by the
// suite's `dashboard_browser` test, which prepares the database (real poison events parked by
// a real relay) and checks the outcome in PostgreSQL and Kafka afterwards.
//
// Environment: DASHBOARD_URL, POISON_ID (requeue it), DISCARD_ID (discard it), HELD_KEY (release
// it), LOOKUP_CONSUMER and LOOKUP_EVENT (a dedup lookup), LAG_GROUP and LAG_TOTAL (a consumer
// group and its lag summed over its partitions), HELD_GROUP_KEY (a key held by a consumer
// group: release it), SHOTS (folder for screenshots),
// CHROMIUM (default /usr/bin/chromium). Prints one line per step; exits non-zero on the first
// failure.
import { chromium } from "playwright-core";

const url = process.env.DASHBOARD_URL;
const shots = process.env.SHOTS;
const env = (name) => {
  const v = process.env[name];
  if (!v) { throw new Error(`${name} is not set`); }
  return v;
};

function check(ok, what) {
  if (!ok) { throw new Error(`check failed: ${what}`); }
}

async function until(what, timeoutMs, fn) {
  const end = Date.now() + timeoutMs;
  for (;;) {
    if (await fn()) { return; }
    if (Date.now() > end) { throw new Error(`timed out waiting for: ${what}`); }
    await new Promise((r) => setTimeout(r, 300));
  }
}

const text = async (page, selector) => ((await page.textContent(selector)) || "").trim();

async function step(name, fn) {
  const t = Date.now();
  await fn();
  console.log(`ok   ${name} (${Date.now() - t} ms)`);
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run"],
});
const errors = [];
try {
  const context = await browser.newContext({ viewport: { width: 1360, height: 900 } });
  const page = await context.newPage();
  page.on("console", (m) => { if (m.type() === "error") { errors.push(m.text()); } });
  page.on("pageerror", (e) => errors.push(String(e)));
  const poison = env("POISON_ID");
  const discard = env("DISCARD_ID");
  const held = env("HELD_KEY");

  await step("overview shows the parked events and refreshes while visible", async () => {
    await page.goto(`${url}/`);
    check(await text(page, "#card-parked b") === "6", "6 parked on the overview");
    const bars = await page.$$eval("#chart-published rect", (rs) => rs.filter((r) => Number(r.getAttribute("height")) > 0).length);
    check(bars > 0, "the publish chart has a bar");
    check((await text(page, "#chart-published")).includes("; 50 in all"), "the publish chart counts the 50 published");
    check((await text(page, "#chart-parked")).includes("; 6 in all"), "the parked chart counts the 6 parked");
    // The consumer group's lag, from the broker's high watermarks, summed on the group's one
    // row; its partitions listed on demand.
    const groupRows = await page.$$eval("#consumers > tbody > tr", (rows, group) => rows
      .filter((r) => r.cells[0].textContent.trim() === group)
      .map((r) => r.cells[3].textContent.trim()), env("LAG_GROUP"));
    check(groupRows.length === 1, `one row for the group (shown: ${groupRows.length})`);
    check(Number(groupRows[0]) === Number(env("LAG_TOTAL")), `the consumer group's lag is ${env("LAG_TOTAL")} (shown: ${groupRows[0]})`);
    const partitionsOf = page.locator("#consumers details table").first();
    check(!(await partitionsOf.isVisible()), "partitions are hidden until asked for");
    await page.click("#consumers details summary");
    check(await partitionsOf.isVisible(), "the group's partitions shown on demand");
    const partitions = await partitionsOf.locator("tbody tr").count();
    check(partitions > 0, `the group's partitions listed (${partitions})`);
    const ticks = await page.$$eval("#chart-published text.tick", (ts) => ts.map((t) => t.textContent));
    check(ticks.length === 5 && ticks[4].endsWith(" UTC"), `the chart's axes are labelled (${ticks.join(" | ")})`);
    await page.waitForFunction(() => document.getElementById("refresh-state").textContent.startsWith("live · updated"), null, { timeout: 10000 });
    await page.screenshot({ path: `${shots}/overview.png`, fullPage: true });
    await page.evaluate(() => {
      Object.defineProperty(document, "hidden", { value: true, configurable: true });
      document.dispatchEvent(new Event("visibilitychange"));
    });
    check(await text(page, "#refresh-state") === "paused (tab hidden)", "refresh pauses when the tab is hidden");
  });

  await step("the poison event is listed, and its markup renders as text", async () => {
    await page.goto(`${url}/parked`);
    check((await text(page, "#parked-events")).includes(poison), "the poison event is listed");
    await page.screenshot({ path: `${shots}/parked.png`, fullPage: true });
    await page.click(`a[href$="/parked/${poison}"]`);
    check((await text(page, "#event-key")).includes("<script>"), "the key is shown as text");
    check(await page.evaluate(() => window.__pwned) === undefined, "the key's script did not run");
    check(await text(page, "#event-status") === "failed", "the event is parked");
    await page.screenshot({ path: `${shots}/event.png`, fullPage: true });
  });

  await step("requeue it with the button, confirm, and watch it publish", async () => {
    await page.click("[data-test=requeue-one]");
    check(await text(page, "#confirm-count b") === "1", "the confirmation shows 1");
    await page.click("[data-test=confirm]");
    check((await text(page, "#result")).startsWith("Requeued 1 event(s)"), "requeued");
    await until("the requeued event published", 30000, async () => {
      await page.goto(`${url}/parked/${poison}`);
      return (await text(page, "#event-status")) === "published";
    });
  });

  await step("discard one with confirmation", async () => {
    await page.goto(`${url}/parked?event_id=${discard}`);
    await page.click("[data-test=discard-one]");
    check(await text(page, "#confirm-count b") === "1", "the confirmation shows 1");
    const listed = await page.$$eval("#confirm-list tbody tr", (rs) => rs.map((r) => r.cells[0].textContent.trim()));
    check(listed.length === 1 && listed[0] === env("DISCARD_ID"), `the confirmation lists the event it discards (${listed})`);
    await page.screenshot({ path: `${shots}/confirm.png`, fullPage: true });
    await page.click("[data-test=confirm]");
    check((await text(page, "#result")).startsWith("Discarded 1"), "discarded");
    await page.goto(`${url}/parked`);
    check(!(await text(page, "#live")).includes(discard), "the discarded event is gone");
  });

  await step("bulk requeue by filter", async () => {
    await page.goto(`${url}/parked`);
    await page.fill("input[name=event_type]", "bulk.retry");
    await page.click("form.filters button[type=submit]");
    check(await text(page, "#parked-total b") === "3", "3 match the filter");
    await page.click("[data-test=requeue-all]");
    check(await text(page, "#confirm-count b") === "3", "the confirmation shows 3");
    await page.click("[data-test=confirm]");
    check((await text(page, "#result")).startsWith("Requeued 3"), "requeued 3");
    await until("the bulk events published", 30000, async () => {
      await page.goto(`${url}/parked?event_type=bulk.retry`);
      return (await text(page, "#parked-total b")) === "0";
    });
  });

  await step("the blocked key shows what waits, and releases in order", async () => {
    await page.goto(`${url}/blocked`);
    const row = page.locator("#blocked-keys tr", { hasText: held });
    check(await row.locator("[data-test=waiting]").textContent() === "3", "3 wait behind the head");
    await page.screenshot({ path: `${shots}/blocked.png`, fullPage: true });
    await row.locator("[data-test=release]").click();
    check(await text(page, "#confirm-count b") === "1", "the confirmation shows the head");
    await page.click("[data-test=confirm]");
    await until("the key released", 30000, async () => {
      await page.goto(`${url}/blocked`);
      return (await text(page, "#live")).includes("No key is held back.");
    });
  });

  await step("a held key is listed, and released with a confirmation listing its events", async () => {
    await page.goto(`${url}/held`);
    const row = page.locator("#held-keys tbody tr", { hasText: env("HELD_GROUP_KEY") });
    check(await row.count() === 1, "the held key is listed");
    check((await row.locator("[data-test=held-count]").textContent()) === "2", "2 records wait behind it, the head included");
    await page.screenshot({ path: `${shots}/held.png`, fullPage: true });
    await row.locator("[data-test=release-held]").click();
    check(await text(page, "#confirm-count b") === "2", "the confirmation counts the held records");
    check(await page.locator("#confirm-list li").count() === 1, "and lists them by partition");
    await page.click("[data-test=confirm]");
    check((await text(page, "#result")).startsWith("Release asked for 2 held record(s)"), "release asked");
    await page.goto(`${url}/held`);
    check((await page.locator("#held-keys tbody tr", { hasText: env("HELD_GROUP_KEY") }).textContent()).includes("retry asked"), "the page shows the release under way");
  });

  await step("pause and resume a consumer group", async () => {
    await page.goto(`${url}/pauses`);
    await page.selectOption("select[name=side]", "consumer");
    await page.fill("input[name=group]", "browser-paused");
    await page.fill("input[name=reason]", "incident 42");
    await page.click("[data-test=pause]");
    await page.click("[data-test=confirm]");
    check((await text(page, "#result")).startsWith("Paused"), "paused");
    await page.goto(`${url}/pauses`);
    check((await text(page, "#pauses")).includes("incident 42"), "the pause is listed with its reason");
    await page.screenshot({ path: `${shots}/pauses.png`, fullPage: true });
    await page.click("[data-test=resume]");
    await page.click("[data-test=confirm]");
    check((await text(page, "#result")).startsWith("Resumed"), "resumed");
  });

  await step("dead letters, dedup lookup and the audit trail", async () => {
    await page.goto(`${url}/dead-letters`);
    check(await text(page, "#dead-total b") === "1", "one open dead letter");
    await page.screenshot({ path: `${shots}/dead-letters.png`, fullPage: true });
    await page.goto(`${url}/lookup`);
    await page.fill("input[name=consumer]", env("LOOKUP_CONSUMER"));
    await page.fill("input[name=event_id]", env("LOOKUP_EVENT"));
    await page.click("form.filters button[type=submit]");
    check((await text(page, "#verdict")).startsWith("Yes"), "the dedup row is found");
    await page.screenshot({ path: `${shots}/lookup.png`, fullPage: true });
    await page.goto(`${url}/audit`);
    const actions = await page.locator("#audit tbody tr td:nth-child(5)").allTextContents();
    check(JSON.stringify(actions) === JSON.stringify(["resume", "pause", "release-held", "release-key", "requeue", "discard", "requeue"]), `audit rows ${JSON.stringify(actions)}`);
    await page.screenshot({ path: `${shots}/audit.png`, fullPage: true });
  });
  check(errors.length === 0, `no console errors (CSP violations included): ${errors.join(" | ")}`);
  console.log("all steps passed");
} finally {
  await browser.close();
}
