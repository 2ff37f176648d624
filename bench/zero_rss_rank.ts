// One rank of bench/zero_rss.ts and test/memory_zero_rss.test.ts: trains with the real trainer
// (`train()`, as `flotilla train` does) under the config overrides given as arguments, prints
// `[rss] <phase> <wall-clock ms>` markers so the parent can place its samples (a step's also with
// the process's CPU milliseconds so far), and when the run is over prints `[rss] ready <memory
// report as JSON>` and waits for SIGUSR2, so the parent reads VmHWM from /proc/<pid>/status while
// the process still exists.
//   node --import tsx bench/zero_rss_rank.ts --model.nLayer=8 --parallel.zero=3 ...
import { parseConfig } from '../src/config/index.js';
import { train } from '../src/train/trainer.js';

// Wall-clock milliseconds, so the parent can line markers up with its samples.
const mark = (phase: string, extra = ''): void => {
  process.stdout.write(`[rss] ${phase} ${Date.now()}${extra ? ` ${extra}` : ''}\n`);
};
const cfg = parseConfig('', process.argv.slice(2), 'zero_rss_rank');
const rank = Number(process.env.RANK ?? 0);
const print = (line: string): void => {
  const phase = /^\[(\w+)\]/.exec(line)?.[1];
  if (phase) mark(`phase:${phase}`);
  if (line.startsWith('[memory]')) process.stdout.write(`${line}\n`);
};
const summary = await train(cfg, {
  print,
  onStep: (m) => {
    const u = process.memoryUsage(), c = process.cpuUsage();
    mark(`step:${m.step}`, `live ${m.liveTensors} heap ${(u.heapTotal / 2 ** 20).toFixed(0)} ext ${(u.external / 2 ** 20).toFixed(0)} rss ${(u.rss / 2 ** 20).toFixed(0)} cpu ${((c.user + c.system) / 1e3).toFixed(0)}`);
  },
});
// Stay alive (nothing else holds the event loop) until the parent has read VmHWM.
const keepAlive = setInterval(() => {}, 1 << 30);
process.once('SIGUSR2', () => {
  clearInterval(keepAlive);
  process.exit(0);
});
mark('ready', JSON.stringify({ rank, memory: summary.memory ?? null, numParams: summary.numParams }));
