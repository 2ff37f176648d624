// DeviceMesh: the world laid out as a grid with named dims (e.g. pp × dp_replicate × dp_shard × tp).
//
// Ranks fill the grid row-major, the last dim innermost: with sizes [s0, s1, ..., sk] the rank at
// coordinates (c0, ..., ck) is ((c0 * s1 + c1) * s2 + c2) ... The group along a dim is every rank
// that differs from this one only in that dim's coordinate; a group's rank is that coordinate.
// Flattening adjacent dims [a, b] gives one group whose rank is the row-major index (ca * sb + cb),
// e.g. dp_rank = replicate_rank * shard_size + shard_rank: rowMajorIndex is that formula, the only
// copy of it (partition.ts's dpRank calls it).
//
// MeshLayout is the rank arithmetic alone, with no processes, so layouts of any size can be checked
// in tests. DeviceMesh adds the process groups: build() creates the group of every dim (and
// flatten() the flattened ones) on every rank in the same order, as newGroup() requires.
import { getWorld, newGroup, type ProcessGroup } from './process_group.js';

export type MeshSpec = Record<string, number> | readonly (readonly [string, number])[];

/**
 * The row-major index of coordinates (c0, c1, ..., ck), the last innermost: ((c0 * s1 + c1) * s2 +
 * c2) ..., given the sizes of every dim but the outermost (s1..sk), which does not enter it.
 */
export function rowMajorIndex(coords: readonly number[], innerSizes: readonly number[]): number {
  return coords.reduce((acc, c, i) => (i === 0 ? c : acc * innerSizes[i - 1]! + c), 0);
}

/** A mesh that does not fit the world, an unknown dim name, or an invalid flatten. */
export class MeshError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'MeshError';
  }
}

function describeSpec(names: readonly string[], sizes: readonly number[]): string {
  return `{ ${names.map((n, i) => `${n}: ${sizes[i]}`).join(', ')} }`;
}

/** The rank arithmetic of a mesh: coordinates, and which global ranks share a group. */
export class MeshLayout {
  readonly names: readonly string[];
  readonly sizes: readonly number[];
  readonly worldSize: number;
  /** strides[i]: how far the global rank moves when dim i's coordinate grows by one. */
  readonly strides: readonly number[];

  private constructor(names: string[], sizes: number[]) {
    this.names = Object.freeze(names);
    this.sizes = Object.freeze(sizes);
    this.worldSize = sizes.reduce((a, b) => a * b, 1);
    const strides: number[] = new Array(sizes.length).fill(1);
    for (let i = sizes.length - 2; i >= 0; i--) strides[i] = strides[i + 1]! * sizes[i + 1]!;
    this.strides = Object.freeze(strides);
  }

  /**
   * Validates a spec against the world size, once: dim names unique identifiers, sizes positive
   * integers, at most one -1 (inferred as the rest), and a product equal to worldSize.
   */
  static create(spec: MeshSpec, worldSize: number): MeshLayout {
    if (!Number.isInteger(worldSize) || worldSize < 1) throw new MeshError(`world size ${worldSize} must be a positive integer`);
    const entries: [string, number][] = Array.isArray(spec)
      ? (spec as readonly (readonly [string, number])[]).map(([k, v]) => [k, v])
      : Object.entries(spec as Record<string, number>);
    if (entries.length === 0) throw new MeshError('a mesh needs at least one dim, e.g. { dp: -1 }');
    const names = entries.map(([k]) => k);
    const sizes = entries.map(([, v]) => v);
    const shown = describeSpec(names, sizes);
    const seen = new Set<string>();
    for (const n of names) {
      if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(n)) throw new MeshError(`mesh ${shown}: dim name '${n}' must be an identifier (letters, digits, _; not starting with a digit)`);
      if (seen.has(n)) throw new MeshError(`mesh ${shown}: dim name '${n}' appears twice`);
      seen.add(n);
    }
    const inferred = sizes.flatMap((s, i) => (s === -1 ? [i] : []));
    if (inferred.length > 1) {
      throw new MeshError(`mesh ${shown}: only one dim may be -1 (inferred), but ${inferred.map((i) => names[i]).join(' and ')} are`);
    }
    sizes.forEach((s, i) => {
      if (s !== -1 && (!Number.isInteger(s) || s < 1)) throw new MeshError(`mesh ${shown}: ${names[i]} = ${s} must be a positive integer or -1`);
    });
    const fixed = sizes.reduce((a, s) => (s === -1 ? a : a * s), 1);
    if (inferred.length === 1) {
      if (worldSize % fixed !== 0) {
        throw new MeshError(`mesh ${shown} does not fit ${worldSize} ranks: the other dims multiply to ${fixed}, which does not divide ${worldSize}; choose sizes whose product divides the world size`);
      }
      sizes[inferred[0]!] = worldSize / fixed;
    } else if (fixed !== worldSize) {
      throw new MeshError(`mesh ${shown} does not fit ${worldSize} ranks: the sizes multiply to ${fixed}; make them multiply to ${worldSize} (or set one to -1)`);
    }
    return new MeshLayout(names, sizes);
  }

  /** Index of a dim; throws listing the valid names. */
  indexOf(name: string): number {
    const i = this.names.indexOf(name);
    if (i < 0) throw new MeshError(`mesh has no dim '${name}'; valid names: ${this.names.join(', ')}`);
    return i;
  }

  size(name: string): number {
    return this.sizes[this.indexOf(name)]!;
  }

  private checkRank(rank: number): void {
    if (!Number.isInteger(rank) || rank < 0 || rank >= this.worldSize) throw new MeshError(`rank ${rank} is outside the mesh (0..${this.worldSize - 1})`);
  }

  /** Coordinates of a global rank, in dim order. */
  coords(rank: number): number[] {
    this.checkRank(rank);
    return this.sizes.map((s, i) => Math.floor(rank / this.strides[i]!) % s);
  }

  /** Coordinates of a global rank by dim name. */
  coordsByName(rank: number): Record<string, number> {
    const c = this.coords(rank);
    return Object.fromEntries(this.names.map((n, i) => [n, c[i]!]));
  }

  /** The coordinate of a global rank along one dim (its rank in that dim's group). */
  coord(rank: number, name: string): number {
    const i = this.indexOf(name);
    this.checkRank(rank);
    return Math.floor(rank / this.strides[i]!) % this.sizes[i]!;
  }

  /** The global rank at the given coordinates (in dim order, or by name; all dims required). */
  rankAt(coords: readonly number[] | Record<string, number>): number {
    const c = Array.isArray(coords) ? coords : this.names.map((n) => {
      const v = (coords as Record<string, number>)[n];
      if (v === undefined) throw new MeshError(`rankAt: missing coordinate for dim '${n}'`);
      return v;
    });
    if (c.length !== this.names.length) throw new MeshError(`rankAt: ${c.length} coordinates for a ${this.names.length}-dim mesh`);
    return c.reduce((acc, v, i) => {
      if (!Number.isInteger(v) || v < 0 || v >= this.sizes[i]!) throw new MeshError(`rankAt: ${this.names[i]} = ${v} is outside 0..${this.sizes[i]! - 1}`);
      return acc + v * this.strides[i]!;
    }, 0);
  }

  /** Validates a list of dims to flatten: known, adjacent, in mesh order. Returns their indices. */
  contiguousDims(names: readonly string[]): number[] {
    if (names.length === 0) throw new MeshError('flatten needs at least one dim');
    const idx = names.map((n) => this.indexOf(n));
    for (let k = 1; k < idx.length; k++) {
      if (idx[k] !== idx[k - 1]! + 1) {
        throw new MeshError(
          `cannot flatten [${names.join(', ')}]: they must be adjacent and in mesh order (${this.names.join(', ')}); ` +
            'only adjacent dims flatten to a group whose rank is the row-major index of their coordinates',
        );
      }
    }
    return idx;
  }

  /** The size of the group spanning the given adjacent dims. */
  groupSize(names: string | readonly string[]): number {
    const idx = this.contiguousDims(typeof names === 'string' ? [names] : names);
    return idx.reduce((a, i) => a * this.sizes[i]!, 1);
  }

  /**
   * The global ranks in rank's group along the given adjacent dims, in group-rank order (which is
   * ascending global rank, since the grid is row-major).
   */
  groupOf(rank: number, names: string | readonly string[]): number[] {
    const idx = this.contiguousDims(typeof names === 'string' ? [names] : names);
    const c = this.coords(rank);
    for (const i of idx) c[i] = 0;
    const base = this.rankAt(c);
    const inner = this.strides[idx[idx.length - 1]!]!; // the innermost dim's stride
    const count = idx.reduce((a, i) => a * this.sizes[i]!, 1);
    return Array.from({ length: count }, (_, k) => base + k * inner);
  }

  /** Rank's index within its group along the given adjacent dims (row-major over them). */
  rankIn(rank: number, names: string | readonly string[]): number {
    const idx = this.contiguousDims(typeof names === 'string' ? [names] : names);
    const c = this.coords(rank);
    return rowMajorIndex(idx.map((i) => c[i]!), idx.slice(1).map((i) => this.sizes[i]!));
  }

  /**
   * Every group along the given adjacent dims, in a fixed order (by the lowest member): the order
   * in which each rank creates them.
   */
  groups(names: string | readonly string[]): number[][] {
    const list = typeof names === 'string' ? [names] : names;
    const out: number[][] = [];
    const seen = new Set<number>();
    for (let r = 0; r < this.worldSize; r++) {
      if (seen.has(r)) continue;
      const g = this.groupOf(r, list);
      for (const m of g) seen.add(m);
      out.push(g);
    }
    return out;
  }

  toString(): string {
    return `MeshLayout${describeSpec(this.names, this.sizes)}`;
  }
}

/** One (possibly flattened) dim of a mesh, as seen by this rank: its group, size and rank. */
export class MeshDim {
  constructor(
    readonly name: string,
    /** The mesh dims it spans (one, or several when flattened). */
    readonly dims: readonly string[],
    readonly group: ProcessGroup,
  ) {}
  get size(): number {
    return this.group.size;
  }
  get rank(): number {
    return this.group.rank;
  }
  /** Global ranks of this rank's group along the dim. */
  get ranks(): readonly number[] {
    return this.group.ranks;
  }
}

/** The world as a named grid, with the process group of every dim (see the file comment). */
export class DeviceMesh {
  private readonly dimsByName = new Map<string, MeshDim>();

  private constructor(readonly layout: MeshLayout, readonly world: ProcessGroup) {}

  /**
   * Lays the world out as `spec` (dims in the given order, last innermost; one size may be -1) and
   * creates each dim's group. Collective: every rank must call it with the same spec.
   */
  static build(spec: MeshSpec, world: ProcessGroup = getWorld()): DeviceMesh {
    const layout = MeshLayout.create(spec, world.size);
    if (world.ranks.some((g, i) => g !== i)) {
      throw new MeshError(`DeviceMesh.build needs the world group (global ranks 0..${layout.worldSize - 1}), got group '${world.name}'`);
    }
    const mesh = new DeviceMesh(layout, world);
    for (const name of layout.names) mesh.dimsByName.set(name, mesh.makeDim(name, [name]));
    return mesh;
  }

  /** Creates the groups spanning `dims` on every rank (same order everywhere) and returns ours. */
  private makeDim(name: string, dims: readonly string[]): MeshDim {
    const rank = this.world.rank;
    const mine = this.layout.groupOf(rank, dims);
    let group: ProcessGroup | undefined;
    if (mine.length === this.world.size) {
      group = this.world; // one group of everyone: the world itself
    } else {
      for (const ranks of this.layout.groups(dims)) {
        const g = newGroup(ranks, { name, timeoutMs: this.world.timeoutMs });
        if (g) group = g;
      }
    }
    if (!group || group.rank !== this.layout.rankIn(rank, dims)) {
      throw new Error(`internal: mesh dim '${name}' group rank ${group?.rank} differs from the layout's ${this.layout.rankIn(rank, dims)}`);
    }
    return new MeshDim(name, dims, group);
  }

  get names(): readonly string[] {
    return this.layout.names;
  }
  get sizes(): readonly number[] {
    return this.layout.sizes;
  }

  /** The 1-D sub-mesh along a dim (or a flattened dim); throws listing valid names. */
  dim(name: string): MeshDim {
    const d = this.dimsByName.get(name);
    if (!d) {
      const flat = [...this.dimsByName.keys()].filter((k) => !this.layout.names.includes(k));
      throw new MeshError(`mesh has no dim '${name}'; valid names: ${this.layout.names.join(', ')}${flat.length ? ` (flattened: ${flat.join(', ')})` : ''}`);
    }
    return d;
  }

  /** Size of a dim (or flattened dim). */
  size(name: string): number {
    return this.dim(name).size;
  }

  /** This rank's coordinates, by dim name. */
  coords(): Record<string, number> {
    return this.layout.coordsByName(this.world.rank);
  }

  /**
   * Merges adjacent dims into one named dim whose rank is the row-major index over them, e.g.
   * flatten(['dp_replicate', 'dp_shard'], 'dp'): dp rank = replicate_rank * shard_size + shard_rank.
   * Collective: every rank must call it, in the same order.
   */
  flatten(names: readonly string[], as: string): MeshDim {
    this.layout.contiguousDims(names);
    const existing = this.dimsByName.get(as);
    if (existing) {
      if (existing.dims.length === names.length && existing.dims.every((d, i) => d === names[i])) return existing;
      throw new MeshError(`cannot name the flattened dims [${names.join(', ')}] '${as}': that name is taken by [${existing.dims.join(', ')}]`);
    }
    if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(as)) throw new MeshError(`flattened dim name '${as}' must be an identifier`);
    const d = names.length === 1 ? new MeshDim(as, names, this.dim(names[0]!).group) : this.makeDim(as, names);
    this.dimsByName.set(as, d);
    return d;
  }

  toString(): string {
    return `DeviceMesh${describeSpec(this.layout.names, this.layout.sizes)}`;
  }
}
