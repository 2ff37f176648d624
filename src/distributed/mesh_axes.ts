// [Note: mesh axes] The one table of a layout's mesh axes and their order, outermost first
// (torchtitan's): pp, dpReplicate, dpShard, cp, tp. tp is innermost, so a tensor-parallel group is
// neighbouring ranks (one host); cp sits between dpShard and tp, so a cp ring is neighbouring tp
// groups. An axis is named as the layout field that gives its degree. Three readers derive from it:
// the mesh the trainer builds (buildMesh in src/parallel/parallelize.ts), the ranks between a
// group's neighbours that the planner prices (axisStride in plan_terms.ts) and the run header's
// line (describeMesh in src/parallel/layout.ts). Expert parallelism is no axis of its own: it
// borrows its ranks from dpShard x cp (expertMeshDims).

/** The mesh axes, outermost first. */
export const MESH_AXES = ['pp', 'dpReplicate', 'dpShard', 'cp', 'tp'] as const;
export type MeshAxis = (typeof MESH_AXES)[number];

/** A layout's degree on each mesh axis (cp and tp absent: 1), and its expert-parallel degree. */
export type MeshDegrees = { pp: number; dpReplicate: number; dpShard: number; cp?: number; tp?: number; ep?: number };

/** Every mesh axis with its degree, outermost first (the DeviceMesh spec). */
export function meshDims(l: MeshDegrees): [MeshAxis, number][] {
  return MESH_AXES.map((a) => [a, l[a] ?? 1]);
}

/**
 * The grid expert parallelism borrows ([Note: expert parallelism] in src/parallel/expert_parallel.ts):
 * the mesh with its dpShard x cp ranks (the ranks holding the same dense parameters of one replica)
 * split into (dpShardOuter, ep), so ep ranks are neighbours.
 */
export function expertMeshDims(l: MeshDegrees): [string, number][] {
  const ep = l.ep ?? 1;
  return meshDims(l).flatMap(([a, d]): [string, number][] => {
    if (a === 'dpShard') return [['dpShardOuter', (d * (l.cp ?? 1)) / ep]];
    if (a === 'cp') return [['ep', ep]];
    return [[a, d]];
  });
}

/** How far the global rank moves when an axis's coordinate grows by one: the product of the degrees inside it. */
export function meshStride(l: MeshDegrees, axis: MeshAxis): number {
  return meshDims(l).slice(MESH_AXES.indexOf(axis) + 1).reduce((s, [, d]) => s * d, 1);
}
