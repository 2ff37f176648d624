// The ids of a text source, kept on disk between runs. A text source is tokenized in memory when a
// run starts, in every rank: with a BPE tokenizer that is about a second of CPU for the 1.2 MB demo
// corpus, paid again by each rank of each launch. The cache keeps the ids under a key of the text,
// the tokenizer's identity (its merge table, src/data/tokenizer.ts) and the code that tokenizes (the
// tokenizer modules and the versions of the npm tokenizers they call), so a change to any is a miss.
//
// Where: $FLOTILLA_CACHE_DIR/tokens, else $XDG_CACHE_HOME/flotilla/tokens, else
// ~/.cache/flotilla/tokens. FLOTILLA_CACHE_DIR=off turns it off. It is only ever a shortcut: a
// directory that cannot be written, or a file that fails its checks, means tokenizing as before.
//
// A file is written whole under a temporary name and renamed into place, so ranks that miss at the
// same moment each write a complete file and the last rename wins; readers never see half of one.
// Layout: MAGIC, the ids (2 or 4 bytes each, in this machine's byte order), the SHA-256 of the ids.
import { createHash } from 'node:crypto';
import { mkdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { cacheDir } from '../io/cache_dir.js';

const MAGIC = Buffer.from('FLTOKEN1');
const DIGEST_BYTES = 32;

/** The cache's directory, or undefined when FLOTILLA_CACHE_DIR=off. */
export function tokenCacheDir(env: NodeJS.ProcessEnv = process.env): string | undefined {
  return cacheDir('tokens', env);
}

let codeDigest: string | undefined;

/** A digest of the code that turns text into ids: this folder's tokenizer modules and the npm tokenizers' versions. */
function tokenizingCode(): string {
  if (codeDigest !== undefined) return codeDigest;
  const h = createHash('sha256');
  for (const name of ['tokenizer', 'bpe_train']) {
    for (const ext of ['.js', '.ts']) { // compiled (dist/) or the sources under tsx
      try {
        h.update(readFileSync(fileURLToPath(new URL(`./${name}${ext}`, import.meta.url))));
        break;
      } catch { /* the other extension */ }
    }
  }
  for (const pkg of ['@huggingface/tokenizers', 'gpt-tokenizer']) h.update(`${pkg}@${packageVersion(pkg)}`);
  return (codeDigest = h.digest('hex'));
}

/** An installed package's version, read from the package.json above its entry point (not every package exports it). */
function packageVersion(pkg: string): string {
  try {
    let dir = dirname(createRequire(import.meta.url).resolve(pkg));
    for (;;) {
      try {
        const json = JSON.parse(readFileSync(join(dir, 'package.json'), 'utf8')) as { name?: string; version?: string };
        if (json.name === pkg) return json.version ?? '?';
      } catch { /* no package.json here */ }
      const up = dirname(dir);
      if (up === dir) return '?';
      dir = up;
    }
  } catch {
    return '?';
  }
}

function fileFor(dir: string, text: string, tokenizerIdentity: string, wide: boolean): string {
  const key = createHash('sha256').update(tokenizingCode()).update(tokenizerIdentity).update('\0').update(text).digest('hex');
  return join(dir, `${key}.${wide ? 'u32' : 'u16'}`);
}

/** The cached ids of text, or undefined on a miss (or a file that fails its checks). */
function read(file: string, wide: boolean): Uint16Array | Uint32Array | undefined {
  let b: Buffer;
  try {
    b = readFileSync(file);
  } catch {
    return undefined;
  }
  const width = wide ? 4 : 2;
  const n = b.length - MAGIC.length - DIGEST_BYTES;
  if (n < 0 || n % width !== 0 || !b.subarray(0, MAGIC.length).equals(MAGIC)) return undefined;
  const ids = b.subarray(MAGIC.length, MAGIC.length + n);
  if (!createHash('sha256').update(ids).digest().equals(b.subarray(MAGIC.length + n))) return undefined;
  // A copy into memory of its own (the Buffer may be a slice of Node's pool, at any alignment).
  const out = wide ? new Uint32Array(n / 4) : new Uint16Array(n / 2);
  Buffer.from(out.buffer).set(ids);
  return out;
}

function write(dir: string, file: string, tokens: Uint16Array | Uint32Array): void {
  const ids = Buffer.from(tokens.buffer, tokens.byteOffset, tokens.byteLength);
  const tmp = `${file}.${process.pid}.tmp`;
  try {
    mkdirSync(dir, { recursive: true });
    writeFileSync(tmp, Buffer.concat([MAGIC, ids, createHash('sha256').update(ids).digest()]));
    renameSync(tmp, file);
  } catch {
    // A cache that cannot be written costs nothing but the next tokenizing.
    try {
      rmSync(tmp, { force: true });
    } catch { /* the directory itself is missing */ }
  }
}

/**
 * The ids of text under the tokenizer: from the cache when it holds them, else tokenize() (whose
 * ids must lie below 2^16 unless wide) stored for the next run.
 */
export function cachedTokens(text: string, tokenizerIdentity: string, wide: boolean, tokenize: () => ArrayLike<number>, dir = tokenCacheDir()): Uint16Array | Uint32Array {
  const file = dir === undefined ? undefined : fileFor(dir, text, tokenizerIdentity, wide);
  const hit = file === undefined ? undefined : read(file, wide);
  if (hit !== undefined) return hit;
  const ids = tokenize();
  const tokens = wide ? Uint32Array.from(ids) : Uint16Array.from(ids);
  if (dir !== undefined && file !== undefined) write(dir, file, tokens);
  return tokens;
}
