// The fused attention kernel (src/nn/kernels/attention.ts, native/attention.cc) against attention
// op by op (scores, mask, softmax, matmul; k and v repeated per group) in float64: out, lse and
// dq/dk/dv for causal, grouped-query heads, a sliding window, documents, an offset (fewer queries
// than keys, as in generation and a ring block), lengths that are not a multiple of the block, and
// rows that see no key; then bfloat16 against float32 within bfloat16's rounding.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { grad, manualSeed, randn, tensor, tidy, zerosLike, type Tensor } from '../src/tensor/index.js';
import { fusedAttention } from '../src/nn/kernels/attention.js';
import { assertClose } from './oracle/check.js';

interface Case {
  name: string;
  B: number; Hq: number; Hkv: number; Tq: number; Tk: number; D: number;
  offset?: number; window?: number; qDocs?: number[][]; kDocs?: number[][];
}

/** (B, 1, Tq, Tk) 0/1: query i sees key j. */
function allowedMask(c: Case, offset: number): Tensor {
  const a = new Float64Array(c.B * c.Tq * c.Tk);
  for (let b = 0; b < c.B; b++) {
    for (let i = 0; i < c.Tq; i++) {
      for (let j = 0; j < c.Tk; j++) {
        const ip = i + offset;
        const ok = j <= ip && (!c.window || ip - j < c.window) && (!c.qDocs || c.qDocs[b]![i] === c.kDocs![b]![j]);
        a[(b * c.Tq + i) * c.Tk + j] = ok ? 1 : 0;
      }
    }
  }
  return tensor(a, { shape: [c.B, 1, c.Tq, c.Tk], dtype: 'float64' });
}

function reference(q: Tensor, k: Tensor, v: Tensor, c: Case, offset: number): [Tensor, Tensor] {
  const g = c.Hq / c.Hkv;
  const rep = (t: Tensor) => t.unsqueeze(2).expand([c.B, c.Hkv, g, c.Tk, c.D]).reshape([c.B, c.Hq, c.Tk, c.D]);
  const allowed = allowedMask(c, offset);
  const seen = allowed.sum(-1, true).gt(0); // rows with a visible key; the others are filled with 0 and zeroed
  const keep = allowed.gt(0).logicalOr(seen.logicalNot());
  const scores = q.matmul(rep(k).transpose(-2, -1)).mul(1 / Math.sqrt(c.D)).maskedFill(keep.logicalNot(), -Infinity);
  const p = scores.softmax(-1).mul(seen.to('float64'));
  const lse = scores.maskedFill(allowed.gt(0).logicalNot(), -Infinity).exp().sum(-1).log();
  return [p.matmul(rep(v)), lse.expand([c.B, c.Hq, c.Tq])];
}

const cases: Case[] = [
  { name: 'causal', B: 2, Hq: 2, Hkv: 2, Tq: 70, Tk: 70, D: 8 },
  { name: 'grouped-query heads', B: 1, Hq: 4, Hkv: 2, Tq: 67, Tk: 67, D: 12 },
  { name: 'window', B: 1, Hq: 2, Hkv: 1, Tq: 75, Tk: 75, D: 8, window: 9 },
  { name: 'documents', B: 2, Hq: 2, Hkv: 1, Tq: 20, Tk: 20, D: 8,
    qDocs: [[...Array(7).fill(0), ...Array(13).fill(1)], [...Array(12).fill(0), ...Array(3).fill(1), ...Array(5).fill(2)]] },
  { name: 'offset: generation against a cache', B: 1, Hq: 4, Hkv: 2, Tq: 3, Tk: 80, D: 8 },
  // A ring block: queries earlier than part of the keys, so the first rows see no key.
  { name: 'offset: rows with no visible key', B: 1, Hq: 2, Hkv: 1, Tq: 66, Tk: 66, D: 8, offset: -5, window: 30 },
];

for (const c of cases) {
  test(`fused attention: ${c.name} matches op-by-op attention in float64 (out, lse, dq, dk, dv)`, () => {
    tidy(() => {
      manualSeed(7);
      const q = randn([c.B, c.Hq, c.Tq, c.D], { dtype: 'float64', requiresGrad: true });
      const k = randn([c.B, c.Hkv, c.Tk, c.D], { dtype: 'float64', requiresGrad: true });
      const v = randn([c.B, c.Hkv, c.Tk, c.D], { dtype: 'float64', requiresGrad: true });
      const w = randn([c.B, c.Hq, c.Tq, c.D], { dtype: 'float64' });
      const offset = c.offset ?? c.Tk - c.Tq;
      const docs = c.qDocs ? { qDocs: tensor(c.qDocs, { dtype: 'int64' }), kDocs: tensor(c.kDocs ?? c.qDocs, { dtype: 'int32' }) } : {};
      const cc = { ...c, kDocs: c.kDocs ?? c.qDocs };
      const [out, lse] = fusedAttention(q, k, v, { offset: c.offset, window: c.window, ...docs, withLse: true });
      const [ref, refLse] = reference(q, k, v, cc, offset);
      assertClose(out, ref, { rtol: 1e-10, atol: 1e-12 }, 'out');
      assertClose(lse, refLse, { rtol: 1e-10, atol: 1e-12 }, 'lse');
      const got = grad([out.mul(w).sum()], [q, k, v]);
      const want = grad([ref.mul(w).sum()], [q, k, v]);
      for (const [i, n] of ['dq', 'dk', 'dv'].entries()) assertClose(got[i]!, want[i]!, { rtol: 1e-9, atol: 1e-11 }, n);
      if (c.offset !== undefined && c.offset < 0) {
        // The rows that see no key: out 0, lse -inf, and a zero gradient.
        assert.deepEqual(out.narrow(2, 0, -c.offset).abs().sum().item(), 0);
        assert.ok(lse.narrow(2, 0, -c.offset).toNumbers().every((x) => x === -Infinity));
        assert.deepEqual(got[0]!.narrow(2, 0, -c.offset).abs().sum().item(), 0);
      }
    });
  });
}

test('fused attention: bfloat16 matches float32 within bfloat16 rounding (out and gradients)', () => {
  tidy(() => {
    manualSeed(3);
    const make = (shape: number[]) => randn(shape, { dtype: 'float32' }).to('bfloat16').to('float32');
    const q = make([1, 4, 130, 16]), k = make([1, 2, 130, 16]), v = make([1, 2, 130, 16]), w = make([1, 4, 130, 16]);
    const run = (dtype: 'float32' | 'bfloat16') => {
      const [a, b, d] = [q, k, v].map((t) => t.to(dtype).detach().requiresGrad_());
      const out = fusedAttention(a!, b!, d!, { window: 50 });
      assert.equal(out.dtype, dtype);
      return [out, ...grad([out.float().mul(w).sum()], [a!, b!, d!])].map((t) => t!.float());
    };
    const f32 = run('float32'), bf16 = run('bfloat16');
    for (const [i, n] of ['out', 'dq', 'dk', 'dv'].entries()) {
      const scale = f32[i]!.abs().max().item() as number;
      assertClose(bf16[i]!, f32[i]!, { rtol: 2e-2, atol: 2e-2 * scale }, n);
      assert.ok(!zerosLike(f32[i]!).eq(f32[i]!).all().item(), `${n} is not all zero`);
    }
  });
});

test('fused attention: float32 (its vectorised exp) matches float64 op-by-op attention within float32 rounding', () => {
  tidy(() => {
    manualSeed(5);
    const c: Case = { name: 'float32', B: 1, Hq: 4, Hkv: 2, Tq: 100, Tk: 100, D: 16, window: 40 };
    const [q, k, v, w] = [c.Hq, c.Hkv, c.Hkv, c.Hq].map((h) => randn([c.B, h, c.Tq, c.D], { dtype: 'float64' }).mul(2));
    const f32 = [q, k, v].map((t) => t!.float().requiresGrad_()), r64 = [q, k, v].map((t) => t!.detach().requiresGrad_());
    const out = fusedAttention(f32[0]!, f32[1]!, f32[2]!, { window: c.window });
    const [ref] = reference(r64[0]!, r64[1]!, r64[2]!, c, 0);
    assertClose(out.double(), ref, { rtol: 1e-4, atol: 1e-5 }, 'out');
    const got = grad([out.double().mul(w!).sum()], f32), want = grad([ref.mul(w!).sum()], r64);
    for (const [i, n] of ['dq', 'dk', 'dv'].entries()) assertClose(got[i]!.double(), want[i]!, { rtol: 1e-3, atol: 1e-4 }, n);
  });
});
