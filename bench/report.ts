// Shared benchmark helpers: statistics and the docs/BENCHMARKS.md section writer.
import { existsSync, readFileSync, writeFileSync, mkdirSync } from 'node:fs';
import { cpus } from 'node:os';
import { join } from 'node:path';

export function median(xs: number[]): number {
  if (xs.length === 0) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  const m = Math.floor(s.length / 2);
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2;
}

const FILE = join(import.meta.dirname, '..', 'docs', 'BENCHMARKS.md');

/** Replaces (or appends) the section between <!-- name:begin --> and <!-- name:end -->. */
export function writeSection(name: string, body: string): void {
  mkdirSync(join(import.meta.dirname, '..', 'docs'), { recursive: true });
  let doc = existsSync(FILE) ? readFileSync(FILE, 'utf8') : '# Benchmarks\n\nEvery number here was measured by the command shown with it, flotilla and its PyTorch peer in the same run.\n';
  const begin = `<!-- ${name}:begin -->`, end = `<!-- ${name}:end -->`;
  const machine = `_Measured ${new Date().toISOString().slice(0, 10)} on ${cpus().length} x ${cpus()[0]?.model ?? 'cpu'}, Node ${process.version}._`;
  const block = `${begin}\n${body}\n\n${machine}\n${end}`;
  const i = doc.indexOf(begin), j = doc.indexOf(end);
  doc = i >= 0 && j > i ? doc.slice(0, i) + block + doc.slice(j + end.length) : `${doc.trimEnd()}\n\n${block}\n`;
  writeFileSync(FILE, doc);
}
