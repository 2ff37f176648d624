// Tensor parallelism one piece at a time, on 2 real ranks in float64 (test/fixtures/tp_layers_rank.ts,
// one world for every check): Megatron's communication ops (forward values, and backward as the
// adjoint of forward), every style on one layer against its one-process twin (outputs, input
// gradients, whole parameter gradients from the slices), vocab-parallel cross-entropy with ignored
// rows, and the errors of bad plans.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runWorld, parseResults, describeWorld } from './helpers/world.js';

interface Summary { rank: number; passed: number; failed: { name: string; detail: string }[]; names: string[] }

const world = (async () => {
  const r = await runWorld({ nproc: 2, script: 'test/fixtures/tp_layers_rank.ts', timeoutMs: 120_000 });
  assert.deepEqual(r.codes, [0, 0], describeWorld(r));
  return parseResults<Summary>(r.outputs);
})();
// A failing world fails every test below; keep the rejection from going unhandled meanwhile.
world.catch(() => {});

/** Every check whose name starts with one of the prefixes passed on both ranks (and some ran). */
async function expectPassed(prefixes: string[], atLeast: number): Promise<void> {
  const ranks = await world;
  for (const s of ranks) {
    const mine = (n: string) => prefixes.some((p) => n === p || n.startsWith(`${p}.`));
    const failed = s.failed.filter((f) => mine(f.name));
    assert.deepEqual(failed, [], `rank ${s.rank}: ${failed.map((f) => `${f.name}: ${f.detail}`).join('\n')}`);
    const passed = s.names.filter(mine);
    assert.ok(passed.length >= atLeast, `rank ${s.rank}: only ${passed.length} check(s) ran under ${prefixes.join(', ')}: ${passed.join(', ')}`);
  }
}

test('comm ops: forward values and backward = adjoint of forward (copyToRegion, reduceFromRegion, gatherLastDim, scatterLastDim, gatherSequence, reduceScatterSequence, scatterSequence), and the plain collectives along every dim', async () => {
  await expectPassed(['comm'], 7 * 4 + 3 * 4);
});

test('colwise Linear (plain, no bias, chunks=3, sequence-sharded input) equals its one-process twin: output, input gradient, whole weight and bias gradients', async () => {
  await expectPassed(['layer.colwise', 'layer.colwise_noBias', 'layer.colwise_chunks3', 'layer.colwise_seqIn', 'layer.colwise_chunks3_seqIn'], 5 * 4);
});

test('colwise Linear with its output gathered (input replicated and sequence-sharded) equals its one-process twin', async () => {
  await expectPassed(['layer.colwise_gathered', 'layer.colwise_seqIn_gathered'], 2 * 4);
});

// Fails at b95d296: the gathered output of a fused layer comes back rank-major (q0 k0 v0 q1 k1 v1)
// instead of (q, k, v); colwise gathers along the last dim without undoing the per-chunk slicing.
test('colwise Linear with chunks=3 and its output gathered returns the one-process (q, k, v) order', async () => {
  await expectPassed(['layer.colwise_chunks3_gathered'], 4);
});

test('prepareInput: two colwise Linears on one prepared input (replicated and sequence-sharded) equal their one-process twin with one collective each way, not one per Linear', async () => {
  await expectPassed(['layer.prepareInput.replicated', 'layer.prepareInput.sequenceSharded'], 2 * 7);
});

test('rowwise Linear (output replicated and sequence-sharded, with and without bias) equals its one-process twin; the replicated bias gets the whole gradient', async () => {
  await expectPassed(['layer.rowwise', 'layer.rowwise_noBias', 'layer.rowwise_seqOut'], 3 * 4);
});

test('vocab-parallel Embedding (output replicated and sequence-sharded) and a tied embedding + head equal their one-process twins', async () => {
  await expectPassed(['layer.vocabEmbedding', 'layer.vocabEmbedding_seqOut', 'layer.tied'], 2 * 4 + 3);
});

test('sequence-parallel LayerNorm and RMSNorm (sequence-sharded and replicated input): outputs, input gradients and the all-reduced parameter gradients equal one process', async () => {
  await expectPassed(['layer.sequenceParallel_layerNorm', 'layer.sequenceParallel_layerNorm_replicatedIn', 'layer.sequenceParallel_rmsNorm'], 3 * 6);
});

test('lossParallel head leaves the logits sharded over the vocabulary, equal to the twin\'s slices; a colwise + rowwise MLP matches finite differences', async () => {
  await expectPassed(['layer.lossParallel_head', 'layer.lossParallel_head_seqIn', 'layer.mlp'], 2 * 4 + 5);
});

test('sharding a Linear frees its unsharded weight at once: the tensor cache holds 1 / tp of the bytes right after parallelizeModule, before any GC', async () => {
  await expectPassed(['layer.shardFrees'], 2);
});

test('each style leaves the documented slice shapes and placements', async () => {
  await expectPassed(['layer.shapes'], 4);
});

test('vocab-parallel cross-entropy equals F.crossEntropy (mean, sum, none; ignoreIndex -100 and another): loss and logits gradient; ignored rows get no gradient; label smoothing is refused naming the fix', async () => {
  await expectPassed(['ce'], 5 * 2 + 3 + 1);
});

test('chunked cross-entropy from a vocabulary-sharded head (the row max, sums of exponentials and target logits all-reduced once) equals the one-process head and loss: loss, hidden, weight and bias gradients, with ignored rows and label smoothing', async () => {
  await expectPassed(['lce'], 2 * 5);
});

test('bad plans: an entry naming no module, a style on the wrong module class, a dimension tp does not divide, two entries for one module, an unknown style, a prepared input nothing prepares: TensorParallelError naming the entry and the fix; tp without a plan', async () => {
  await expectPassed(['error'], 13 * 2 + 1);
});
