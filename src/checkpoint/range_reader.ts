// Reading byte ranges of a directory's files, each file opened once: how checkpoints and Hugging
// Face directories are read (a rank reads only the bytes of the pieces it holds).
import { closeSync, openSync, readSync } from 'node:fs';
import { join } from 'node:path';
import { CheckpointError } from './format.js';

/** Reads byte ranges of files in `dir`, keeping each file open once; close() when done. */
export class RangeReader {
  private readonly fds = new Map<string, number>();
  constructor(private readonly dir: string) {}
  read(file: string, byte: number, len: number, into?: Buffer, at = 0): Buffer {
    let fd = this.fds.get(file);
    if (fd === undefined) {
      fd = openSync(join(this.dir, file), 'r');
      this.fds.set(file, fd);
    }
    const buf = into ?? Buffer.allocUnsafe(len);
    let got = 0;
    while (got < len) {
      const n = readSync(fd, buf, at + got, len - got, byte + got);
      if (n === 0) throw new CheckpointError(`${join(this.dir, file)}: unexpected end of file at byte ${byte + got} (truncated)`);
      got += n;
    }
    return buf;
  }
  close(): void {
    for (const fd of this.fds.values()) closeSync(fd);
    this.fds.clear();
  }
}
