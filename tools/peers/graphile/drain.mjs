// The Graphile Worker peer of `cifpool-tools bench queue` (see docs/BENCHMARKS.md, "Queue").
//
//   node drain.mjs prepare --jobs N
//       installs Graphile Worker's schema (runMigrations) in the database of the PG* environment and
//       adds N no-op jobs in one `add_jobs` call.
//   node drain.mjs drain --jobs N --concurrency C --local-queue S [--timeout-ms T]
//       starts one worker (C concurrent jobs, local queue of S, batched completion and failure) with a
//       no-op task and times it from just before `run()` until the jobs table is empty.
//
// The connection comes from the PG* variables (PGHOST, PGPORT, PGUSER, PGDATABASE), set by the Rust
// side. Each command prints one JSON object as the last line of stdout (`drain` first prints `ready`
// just before its timed part); Graphile's own log goes to stderr (warnings and errors only), so stdout
// stays parseable.

import { readFileSync } from "node:fs";
import { performance } from "node:perf_hooks";
import { setTimeout as sleep } from "node:timers/promises";
import { Logger, makeWorkerUtils, run, runMigrations } from "graphile-worker";

const version = JSON.parse(
  readFileSync(new URL("./node_modules/graphile-worker/package.json", import.meta.url), "utf8"),
).version;

// Info lines would cost the drain time and clutter the bench's output.
const logger = new Logger(() => (level, message) => {
  if (level === "error" || level === "warning") console.error(`graphile-worker ${level}: ${message}`);
});

function flag(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  if (i < 0) {
    if (fallback === undefined) throw new Error(`--${name} is required`);
    return fallback;
  }
  const value = Number(process.argv[i + 1]);
  if (!Number.isFinite(value)) throw new Error(`--${name} needs a number`);
  return value;
}

async function prepare() {
  const jobs = flag("jobs");
  await runMigrations({ logger });
  const utils = await makeWorkerUtils({ logger });
  try {
    const started = performance.now();
    // One statement, like the JS `addJobs` helper, but with the specs built by the server.
    const { rows } = await utils.withPgClient((client) =>
      client.query(
        `select count(*)::int as added from graphile_worker.add_jobs(array(
           select json_populate_record(null::graphile_worker.job_spec,
                                       json_build_object('identifier', 'noop', 'payload', '{}'::json))
           from generate_series(1, $1::int)))`,
        [jobs],
      ),
    );
    const seconds = (performance.now() - started) / 1000;
    return { command: "prepare", graphile_worker: version, node: process.version, added: rows[0].added, seconds };
  } finally {
    await utils.release();
  }
}

async function drain() {
  const jobs = flag("jobs");
  const concurrency = flag("concurrency");
  const localQueue = flag("local-queue");
  const timeoutMs = flag("timeout-ms", 600_000);
  const utils = await makeWorkerUtils({ logger });
  let done = 0;
  let allRan;
  const ran = new Promise((resolve) => (allRan = resolve));
  const taskList = {
    noop: async () => {
      done += 1;
      if (done >= jobs) allRan();
    },
  };
  let runner;
  try {
    // The Rust side starts its CPU watch on this line: what follows is the measured drain.
    console.log("ready");
    const started = performance.now();
    runner = await run({
      concurrency,
      noHandleSignals: true,
      logger,
      taskList,
      preset: {
        worker: {
          // The batched configuration of Graphile's performance guide: jobs are locked and fetched
          // `localQueue.size` at a time, completions and failures batched (delay >= 0 turns it on).
          localQueue: { size: localQueue },
          completeJobBatchDelay: 0,
          failJobBatchDelay: 0,
        },
      },
    });
    const timeout = sleep(timeoutMs).then(() => {
      throw new Error(`${jobs - done} of ${jobs} jobs still not run after ${timeoutMs} ms`);
    });
    await Promise.race([ran, timeout]);
    // Completions are batched: a job has run before its row is deleted. Empty means finished.
    for (;;) {
      const { rows } = await utils.withPgClient((client) =>
        client.query("select count(*)::int as left from graphile_worker._private_jobs"),
      );
      if (rows[0].left === 0) break;
      if (performance.now() - started > timeoutMs) throw new Error(`${rows[0].left} jobs left after ${timeoutMs} ms`);
      await sleep(5);
    }
    const seconds = (performance.now() - started) / 1000;
    return {
      command: "drain",
      graphile_worker: version,
      node: process.version,
      jobs,
      ran: done,
      seconds,
      jobs_per_s: jobs / seconds,
      concurrency,
      local_queue: localQueue,
    };
  } finally {
    if (runner) await runner.stop();
    await utils.release();
  }
}

const commands = { prepare, drain };
const command = commands[process.argv[2]];
if (!command) {
  console.error(`usage: node drain.mjs prepare|drain --jobs N ...`);
  process.exit(2);
}
try {
  console.log(JSON.stringify(await command()));
  // A pool or timer left behind must not keep the bench waiting.
  process.exit(0);
} catch (e) {
  console.error(`drain.mjs ${process.argv[2]}: ${e?.stack ?? e}`);
  process.exit(1);
}
