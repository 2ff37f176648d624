// The one table of mesh axes ([Note: mesh axes] in src/distributed/mesh_axes.ts) and what is derived
// from it: the DeviceMesh specs buildMesh builds, the strides the planner prices groups with, and
// the run header's line. Checked on every layout of up to 16 ranks, without processes.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { MeshLayout } from '../src/distributed/mesh.js';
import { MESH_AXES, expertMeshDims, meshDims, meshStride } from '../src/distributed/mesh_axes.js';
import { axisStride, type PlanLayout } from '../src/distributed/plan_terms.js';
import { describeMesh, layoutFor } from '../src/parallel/layout.js';

/** Every (pp, dpReplicate, dpShard, cp, tp) whose product is at most 16. */
function layouts(): [number, number, number, number, number][] {
  const out: [number, number, number, number, number][] = [];
  for (let W = 1; W <= 16; W++) {
    const divs = (n: number) => Array.from({ length: n }, (_, i) => i + 1).filter((d) => n % d === 0);
    for (const pp of divs(W)) for (const r of divs(W / pp)) for (const s of divs(W / pp / r)) for (const cp of divs(W / pp / r / s)) out.push([pp, r, s, cp, W / pp / r / s / cp]);
  }
  return out;
}

test('the mesh axes, outermost first, are torchtitan\'s order', () => {
  assert.deepEqual(MESH_AXES, ['pp', 'dpReplicate', 'dpShard', 'cp', 'tp']);
  assert.deepEqual(meshDims({ pp: 2, dpReplicate: 1, dpShard: 4 }), [['pp', 2], ['dpReplicate', 1], ['dpShard', 4], ['cp', 1], ['tp', 1]]);
});

test('the mesh and the expert grid are the specs buildMesh wrote out by hand', () => {
  for (const [pp, dpReplicate, dpShard, cp, tp] of layouts()) {
    const l = { pp, dpReplicate, dpShard, cp, tp };
    assert.deepEqual(meshDims(l), [['pp', pp], ['dpReplicate', dpReplicate], ['dpShard', dpShard], ['cp', cp], ['tp', tp]]);
    for (let ep = 2; ep <= dpShard * cp; ep++) {
      if ((dpShard * cp) % ep !== 0) continue;
      assert.deepEqual(expertMeshDims({ ...l, ep }), [['pp', pp], ['dpReplicate', dpReplicate], ['dpShardOuter', (dpShard * cp) / ep], ['ep', ep], ['tp', tp]]);
    }
    // A stride is how far the global rank moves along the axis in the mesh itself.
    const M = MeshLayout.create(meshDims(l), pp * dpReplicate * dpShard * cp * tp);
    MESH_AXES.forEach((a, i) => assert.equal(meshStride(l, a), M.strides[i], `${a} of ${JSON.stringify(l)}`));
  }
});

test('the planner\'s strides are the ones it used before the table, for ZeRO and without', () => {
  for (const [pp, dpReplicate, dpShard, cp, tp] of layouts()) {
    const dp = dpReplicate * dpShard;
    for (const zero of [0, 3] as const) {
      if (zero === 0 && dpReplicate > 1) continue;
      const l: PlanLayout = {
        dp, zero, dpShard: zero === 0 ? -1 : dpShard, dpReplicate, pp, ppSchedule: '1f1b', ppVirtualStages: 1, tp, sequenceParallel: false, cp, ep: 1,
        microBatches: 1, activationCheckpoint: 'none', precision: 'fp32',
      };
      const shard = zero === 0 ? dp : dpShard;
      const before = { tp: 1, cp: tp, dpShard: tp, dp: tp, dpReplicate: tp * cp * shard, pp: tp * cp * dp };
      for (const [g, s] of Object.entries(before)) assert.equal(axisStride(l, g as keyof typeof before), s, `${g} of ${JSON.stringify(l)}`);
    }
  }
});

test('the run header names every axis with its degree', () => {
  assert.equal(describeMesh(layoutFor({ pp: 2, zero: 3, dpReplicate: 2, cp: 2 }, 16)), 'mesh pp 2 x dpReplicate 2 x dpShard 2 x cp 2 x tp 1');
  assert.equal(describeMesh(layoutFor({}, 4)), 'mesh pp 1 x dpReplicate 1 x dpShard 4 x cp 1 x tp 1');
});
