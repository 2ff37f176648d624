// Packed documents inside the models ([Note: documents] in src/nn/documents.ts): rows holding three
// documents and a trailing pad document, run inside withDocuments, give every document the logits
// (and the parameters the gradients) of that document run alone, which test/oracle/packed.py
// computes document by document in PyTorch: the GPT (learned positions) and the Llama (rotary,
// grouped-query heads), float32 and float64. Also under bf16-mixed (against each document alone
// in bf16-mixed), with full and selective activation checkpointing (whose recomputes must see the
// same documents), and without the documents the logits must differ. (Rotary attention depends on
// position differences only, so for the Llama it is the mask that these checks see; the GPT's learned
// positions show the restart at each document.)
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { type DType, type Tensor, manualSeed, noGrad, randint, randn, setDefaultDtype, setNumThreads, tensor, tidy, cat } from '../src/tensor/index.js';
import { GPT } from '../src/models/gpt.js';
import { Llama } from '../src/models/llama.js';
import { documentLayout, withDocuments, type DocumentLayout } from '../src/nn/documents.js';
import { withActivationCheckpoint, type ActivationCheckpoint } from '../src/nn/checkpoint.js';
import { autocast } from '../src/nn/precision.js';
import { runOracle, oracleMissing } from './oracle/oracle.js';
import { scaledErr } from './oracle/check.js';

setNumThreads(1);
const skip = oracleMissing();

const B = 2, T = 16, V = 37;
// Document lengths per row; the last is the row's pads (one trailing document).
const ROWS = [[5, 4, 4, 3], [3, 8, 2, 3]];
type Arch = 'gpt' | 'llama';
type Model = GPT | Llama;

function layoutArrays(): { pos: Int32Array; ids: Int32Array } {
  const pos = new Int32Array(B * T), ids = new Int32Array(B * T);
  ROWS.forEach((lengths, b) => {
    let t = b * T;
    lengths.forEach((L, d) => {
      for (let k = 0; k < L; k++, t++) {
        pos[t] = k;
        ids[t] = d;
      }
    });
  });
  return { pos, ids };
}

function build(arch: Arch, dtype: DType): Model {
  setDefaultDtype(dtype === 'float64' ? 'float64' : 'float32');
  try {
    manualSeed(1234);
    const model = arch === 'gpt'
      ? new GPT({ vocabSize: V, blockSize: T, nLayer: 2, nHead: 2, nEmbd: 16 })
      : new Llama({ vocabSize: V, blockSize: T, nLayer: 2, nHead: 4, nKvHead: 2, nEmbd: 16, intermediateSize: 32, tieEmbeddings: false });
    // Weights far from the init's 0.02, so activations are O(1) and every path matters.
    noGrad(() => {
      for (const [name, p] of model.namedParameters()) {
        if (/(ln\w*|Norm|norm)\.weight$/.test(name)) p.normal_(1, 0.3);
        else p.normal_(0, 0.4);
      }
    });
    return model;
  } finally {
    setDefaultDtype('float32');
  }
}

interface Run { logits: Tensor; grads: Record<string, Tensor> }

/** Logits of idx and the parameters' gradients of sum(logits * w), inside `docs` when given. */
function run(model: Model, idx: Tensor, w: Tensor, docs: DocumentLayout | undefined, o: { checkpoint?: ActivationCheckpoint; bf16?: boolean } = {}): Run {
  for (const p of model.parameters()) p.grad = undefined;
  const logits = withDocuments(docs, () => withActivationCheckpoint(o.checkpoint ?? 'none', () => {
    const fwd = () => model.forward(idx).logits;
    const l = o.bf16 ? autocast('bf16-mixed', fwd) : fwd();
    l.to(w.dtype).mul(w).sum().backward(); // inside the documents: the recomputes run here
    return l.detach().to(w.dtype);
  }));
  const grads = Object.fromEntries(model.namedParameters().map(([n, p]) => [n, p.grad!]));
  return { logits, grads };
}

function inputs(dtype: DType): { idx: Tensor; w: Tensor } {
  manualSeed(99);
  const idx = randint(1, V, [B, T]);
  // The pad document's tokens are the eot id, 0.
  const { ids } = layoutArrays();
  const padded = tensor(Int32Array.from(idx.toNumbers(), (x, i) => (ids[i] === ROWS[Math.floor(i / T)]!.length - 1 ? 0 : x)), { shape: [B, T], dtype: 'int64' });
  return { idx: padded, w: randn([B, T, V], { dtype: dtype === 'float64' ? 'float64' : 'float32' }) };
}

function againstOracle(arch: Arch, dtype: 'float32' | 'float64', tol: number): void {
  const model = build(arch, dtype);
  const { pos, ids } = layoutArrays();
  const docs = documentLayout(pos, ids, B, T);
  tidy(() => {
    const { idx, w } = inputs(dtype);
    const mine = run(model, idx, w, docs);
    const params = Object.fromEntries(model.namedParameters());
    const ref = runOracle('packed', { ...params, idx, ids: docs.ids, w }, { arch, ...model.cfg }).tensors;
    const err = scaledErr(mine.logits, ref.logits!);
    assert.ok(err <= tol, `${arch} ${dtype}: packed logits are ${err} from each document run alone`);
    for (const [name, g] of Object.entries(mine.grads)) {
      const e = scaledErr(g, ref[`grad.${name}`]!);
      assert.ok(e <= tol, `${arch} ${dtype}: gradient of ${name} is ${e} from the documents' alone`);
    }
    // Without the documents every token after the first document reads the ones before it.
    const off = run(model, idx, w, undefined);
    const offErr = scaledErr(off.logits, ref.logits!);
    assert.ok(offErr > 1e3 * tol && offErr > 1e-3, `${arch} ${dtype}: without documents the logits are only ${offErr} away`);
    // ... and the first document of each row is unchanged (causality alone isolates it).
    const first = (t: Tensor) => cat(ROWS.map((r, b) => t.select(0, b).narrow(0, 0, r[0]!)), 0);
    assert.ok(scaledErr(first(off.logits), first(ref.logits!)) <= tol);
    for (const t of Object.values(ref)) t.dispose();
  });
  docs.dispose();
  model.dispose();
}

for (const arch of ['gpt', 'llama'] as const) {
  const what = arch === 'gpt' ? 'GPT (learned positions)' : 'Llama (rotary, grouped-query)';
  test(`${what}: each packed document's logits and gradients equal the document alone in PyTorch (float32)`, { skip }, () => {
    againstOracle(arch, 'float32', 1e-5);
  });
  test(`${what}: the same in float64`, { skip }, () => {
    againstOracle(arch, 'float64', 1e-12);
  });

  test(`${what}: full and selective activation checkpointing recompute inside the same documents`, () => {
    const model = build(arch, 'float64');
    const { pos, ids } = layoutArrays();
    const docs = documentLayout(pos, ids, B, T);
    tidy(() => {
      const { idx, w } = inputs('float64');
      const plain = run(model, idx, w, docs);
      for (const checkpoint of ['full', 'selective'] as const) {
        const r = run(model, idx, w, docs, { checkpoint });
        assert.deepEqual(r.logits.toNumbers(), plain.logits.toNumbers(), `${checkpoint}: logits`);
        for (const [name, g] of Object.entries(plain.grads)) {
          const e = scaledErr(r.grads[name]!, g);
          assert.ok(e <= 1e-14, `${checkpoint}: gradient of ${name} is ${e} from the plain run's`);
        }
      }
    });
    docs.dispose();
    model.dispose();
  });

  test(`${what}: under bf16-mixed each packed document's logits are those of the document alone`, () => {
    const model = build(arch, 'float32');
    const { pos, ids } = layoutArrays();
    const docs = documentLayout(pos, ids, B, T);
    tidy(() => {
      const { idx, w } = inputs('float32');
      const packed = run(model, idx, w, docs, { bf16: true }).logits;
      const off = run(model, idx, w, undefined, { bf16: true }).logits;
      // Each document alone, in bf16-mixed too.
      const alone = cat(ROWS.map((lengths, b) => {
        let s = 0;
        return cat(lengths.map((L) => {
          const l = autocast('bf16-mixed', () => model.forward(idx.select(0, b).narrow(0, s, L).unsqueeze(0)).logits).to('float32');
          s += L;
          return l.select(0, 0);
        }), 0).unsqueeze(0);
      }), 0);
      // Both sides round to bfloat16 (8 bits) along different GEMM shapes: a few ulps of the largest
      // logit through two layers (1-2 seen); without the documents the distance is of order 1.
      const err = scaledErr(packed, alone), offErr = scaledErr(off, alone);
      assert.ok(err <= 4e-2, `${arch} bf16-mixed: packed logits are ${err} from each document alone`);
      assert.ok(offErr > 0.2, `${arch} bf16-mixed: without documents only ${offErr} away (with: ${err})`);
    });
    docs.dispose();
    model.dispose();
  });
}

test('documentLayout refuses rows whose ids decrease or whose positions do not restart at each document', () => {
  assert.throws(() => documentLayout(new Int32Array([0, 1, 0, 0]), new Int32Array([0, 0, 1, 0]), 1, 4), /must not decrease/);
  assert.throws(() => documentLayout(new Int32Array([0, 1, 1, 2]), new Int32Array([0, 0, 1, 1]), 1, 4), /a document starts there/);
  assert.throws(() => documentLayout(new Int32Array([0, 1]), new Int32Array([0, 0]), 1, 4), /need 4 positions/);
});
