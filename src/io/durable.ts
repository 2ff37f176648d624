// Files that survive a crash whole or not at all, and their SHA-256: what checkpoints and prepared
// datasets both write and verify.
import { createHash } from 'node:crypto';
import { closeSync, fsyncSync, openSync, readSync, renameSync, writeSync } from 'node:fs';

/** Writes a file and fsyncs it (not atomic: a crash may leave part of it; see writeDurable). */
export function writeSynced(path: string, data: string | Uint8Array): void {
  const bytes = typeof data === 'string' ? Buffer.from(data) : data;
  const fd = openSync(path, 'w');
  try {
    let done = 0;
    while (done < bytes.byteLength) done += writeSync(fd, bytes, done, bytes.byteLength - done);
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

/**
 * Writes a file through a fsync'd temp file (`PATH.tmp`) and a rename, so the path holds either the
 * old contents or all of the new. fsyncDir(dirname(path)) afterwards makes the rename itself durable.
 */
export function writeDurable(path: string, data: string | Uint8Array): void {
  const tmp = `${path}.tmp`;
  writeSynced(tmp, data);
  renameSync(tmp, path);
}

// A filesystem that cannot fsync a directory says so with one of these; the renames stay atomic.
const DIR_FSYNC_UNSUPPORTED = new Set(['EINVAL', 'ENOTSUP', 'EOPNOTSUPP', 'EISDIR', 'EPERM', 'EBADF']);

/** fsyncs a directory, so a rename or a new file in it survives a crash. */
export function fsyncDir(dir: string): void {
  let fd: number;
  try {
    fd = openSync(dir, 'r');
  } catch (e) {
    if (DIR_FSYNC_UNSUPPORTED.has((e as NodeJS.ErrnoException).code ?? '')) return;
    throw e;
  }
  try {
    fsyncSync(fd);
  } catch (e) {
    if (!DIR_FSYNC_UNSUPPORTED.has((e as NodeJS.ErrnoException).code ?? '')) throw e;
  } finally {
    closeSync(fd);
  }
}

/** SHA-256 (hex) of a file, streamed in 4 MiB reads. */
export function fileSha256(path: string): string {
  const h = createHash('sha256');
  const fd = openSync(path, 'r');
  try {
    const buf = Buffer.allocUnsafe(4 << 20);
    for (;;) {
      const n = readSync(fd, buf, 0, buf.length, null);
      if (n === 0) break;
      h.update(buf.subarray(0, n));
    }
  } finally {
    closeSync(fd);
  }
  return h.digest('hex');
}
