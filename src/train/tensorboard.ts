// TensorBoard event files ([log] tensorboard = true): RUN/tb/events.out.tfevents.<seconds>.<host>,
// the TFRecord framing TensorBoard reads (each record: its length as u64 little-endian, the masked
// CRC32C of those 8 bytes, the data, the masked CRC32C of the data) around Event protobufs: the
// first names the file version, the others carry scalar summaries at a step, and the run's config
// as a text summary (the text plugin's form: a string tensor under plugin "text").
//
// [Note: tensorboard resume] A resumed run keeps the events of the steps up to its checkpoint,
// drops the ones a killed run wrote after it (they are trained again, as metrics.jsonl drops its
// lines), and writes the new steps into a new file of the directory (TensorBoard merges a
// directory's files), so no step appears twice.
import { closeSync, existsSync, mkdirSync, openSync, readdirSync, readFileSync, renameSync, writeFileSync, writeSync } from 'node:fs';
import { hostname } from 'node:os';
import { join } from 'node:path';
import protobuf from 'protobufjs';
import type { StepMetrics } from './metrics.js';

// The few messages of TensorFlow's event.proto, summary.proto and tensor.proto written here, with
// their field numbers there.
const root = protobuf.Root.fromJSON({
  nested: {
    Event: {
      fields: {
        wallTime: { type: 'double', id: 1 }, step: { type: 'int64', id: 2 },
        fileVersion: { type: 'string', id: 3 }, summary: { type: 'Summary', id: 5 },
      },
    },
    Summary: { fields: { value: { rule: 'repeated', type: 'Value', id: 1 } } },
    Value: {
      fields: {
        tag: { type: 'string', id: 1 }, simpleValue: { type: 'float', id: 2 },
        tensor: { type: 'TensorProto', id: 8 }, metadata: { type: 'SummaryMetadata', id: 9 },
      },
    },
    SummaryMetadata: { fields: { pluginData: { type: 'PluginData', id: 1 } } },
    PluginData: { fields: { pluginName: { type: 'string', id: 1 }, content: { type: 'bytes', id: 2 } } },
    TensorProto: {
      fields: {
        dtype: { type: 'int32', id: 1 }, tensorShape: { type: 'TensorShapeProto', id: 2 },
        stringVal: { rule: 'repeated', type: 'bytes', id: 8 },
      },
    },
    TensorShapeProto: { fields: { dim: { rule: 'repeated', type: 'Dim', id: 2 } } },
    Dim: { fields: { size: { type: 'int64', id: 1 } } },
  },
});
const Event = root.lookupType('Event');
const DT_STRING = 7;

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), and TFRecord's mask of it.
const CRC_TABLE = (() => {
  const t = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? (c >>> 1) ^ 0x82f63b78 : c >>> 1;
    t[n] = c >>> 0;
  }
  return t;
})();

export function crc32c(b: Uint8Array): number {
  let c = 0xffffffff;
  for (let i = 0; i < b.length; i++) c = CRC_TABLE[(c ^ b[i]!) & 0xff]! ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

export function maskedCrc32c(b: Uint8Array): number {
  const c = crc32c(b);
  return ((((c >>> 15) | (c << 17)) >>> 0) + 0xa282ead8) >>> 0;
}

/** One TFRecord around `data`. */
function record(data: Uint8Array): Buffer {
  const out = Buffer.alloc(8 + 4 + data.length + 4);
  out.writeBigUInt64LE(BigInt(data.length), 0);
  out.writeUInt32LE(maskedCrc32c(out.subarray(0, 8)), 8);
  out.set(data, 12);
  out.writeUInt32LE(maskedCrc32c(data), 12 + data.length);
  return out;
}

/** The records of an events file, up to the first one cut short (a killed run's last write). */
function records(buf: Buffer): Buffer[] {
  const out: Buffer[] = [];
  for (let at = 0; at + 12 <= buf.length;) {
    const n = Number(buf.readBigUInt64LE(at));
    if (at + 16 + n > buf.length || buf.readUInt32LE(at + 8) !== maskedCrc32c(buf.subarray(at, at + 8))) break;
    const data = buf.subarray(at + 12, at + 12 + n);
    if (buf.readUInt32LE(at + 12 + n) !== maskedCrc32c(data)) break;
    out.push(Buffer.from(data));
    at += 16 + n;
  }
  return out;
}

const stepOf = (data: Uint8Array): number => Number((Event.decode(data) as unknown as { step?: number | { toNumber(): number } }).step?.valueOf() ?? 0);

/** The scalars of a metrics row, by tag (what a step's event carries). */
export function scalarsOf(m: StepMetrics): Record<string, number> {
  const s: Record<string, number> = { 'train/loss': m.loss, 'train/lr': m.lr, 'perf/tokens_per_sec': m.tokensPerSec };
  const opt: [string, number | undefined][] = [
    ['val/loss', m.valLoss], ['train/grad_norm', m.gradNorm], ['perf/tflops', m.tflops], ['perf/mfu', m.mfu], ['memory/rss_mib', m.rssMiB],
    ['moe/aux_loss', m.auxLoss], ['moe/dropped_tokens', m.droppedTokens],
    ['dpo/rewards_chosen', m.rewardsChosen], ['dpo/rewards_rejected', m.rewardsRejected], ['dpo/rewards_margin', m.rewardsMargin], ['dpo/rewards_accuracy', m.rewardsAccuracy],
  ];
  for (const [tag, v] of opt) if (v !== undefined) s[tag] = v;
  // Each MoE layer's expert load: the share of the layer's assignments each expert took.
  for (const [name, counts] of Object.entries(m.expertTokens ?? {})) {
    const total = counts.reduce((a, b) => a + b, 0);
    const layer = /^layers\.(\d+)\./.exec(name)?.[1];
    counts.forEach((c, e) => { s[`moe/${layer !== undefined ? `layer${layer}` : name}/expert${e}_load`] = total > 0 ? c / total : 0; });
  }
  return s;
}

export class TensorBoardWriter {
  readonly path: string;
  private fd: number | undefined;

  /**
   * A new events file in `dir`; with `continueAfter` (a resumed run) the directory's earlier files
   * keep only the steps up to it ([Note: tensorboard resume]).
   */
  constructor(readonly dir: string, opts: { continueAfter?: number } = {}) {
    mkdirSync(dir, { recursive: true });
    if (opts.continueAfter !== undefined) {
      for (const f of readdirSync(dir).filter((f) => f.startsWith('events.out.tfevents.'))) {
        const file = join(dir, f), all = readFileSync(file);
        const keep = records(all).filter((r) => stepOf(r) <= opts.continueAfter!);
        const out = Buffer.concat(keep.map(record));
        if (out.equals(all)) continue;
        writeFileSync(`${file}.tmp`, out);
        renameSync(`${file}.tmp`, file);
      }
    }
    // TensorBoard's name: seconds since the epoch and the host; a later second when one is taken.
    let secs = Math.floor(Date.now() / 1000);
    while (existsSync(join(dir, `events.out.tfevents.${secs}.${hostname()}`))) secs++;
    this.path = join(dir, `events.out.tfevents.${secs}.${hostname()}`);
    this.fd = openSync(this.path, 'w');
    this.event({ fileVersion: 'brain.Event:2' }, 0);
  }

  private event(fields: Record<string, unknown>, step: number): void {
    if (this.fd === undefined) throw new Error(`TensorBoardWriter: ${this.path} is closed`);
    writeSync(this.fd, record(Event.encode(Event.create({ wallTime: Date.now() / 1000, step, ...fields })).finish()));
  }

  /** The scalars of one step's metrics row. */
  step(m: StepMetrics): void {
    this.event({ summary: { value: Object.entries(scalarsOf(m)).map(([tag, simpleValue]) => ({ tag, simpleValue })) } }, m.step);
  }

  /** A text summary (TensorBoard's text plugin: a scalar string tensor), rendered as Markdown. */
  text(tag: string, text: string, step: number): void {
    const value = {
      tag, metadata: { pluginData: { pluginName: 'text' } },
      tensor: { dtype: DT_STRING, tensorShape: {}, stringVal: [Buffer.from(text, 'utf8')] },
    };
    this.event({ summary: { value: [value] } }, step);
  }

  close(): void {
    if (this.fd !== undefined) {
      closeSync(this.fd);
      this.fd = undefined;
    }
  }
}
