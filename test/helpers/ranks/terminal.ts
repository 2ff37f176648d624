// Rank script of test/distributed_launcher_terminal.test.ts: says which progress mode rank 0 would
// pick, and writes a marker where its progress bar would be drawn. No process group is joined.
import { barStream, resolveProgressMode } from '../../../src/train/progress.js';

const rank = Number(process.env.RANK ?? process.env.OMPI_COMM_WORLD_RANK ?? 0);
const mode = resolveProgressMode('auto');
console.log(`MODE ${rank} ${mode}`);
if (rank === 0 && mode === 'bar') barStream()!.write('BAR-MARK drawn on the terminal\n');
