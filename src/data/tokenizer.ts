// Byte-level tokenizer: a token is one byte of the UTF-8 encoding, so the vocabulary is 256, every
// string round-trips, and no merge table has to be trained, shipped or versioned.

/** Token ids as stored by datasets and loaders. */
export type TokenArray = Uint8Array | Uint16Array | Int32Array;

export class ByteTokenizer {
  /** Number of distinct ids (0..255). */
  readonly vocabSize = 256;

  /** UTF-8 bytes of text, one id per byte. */
  encode(text: string): Uint8Array {
    const b = Buffer.from(text, 'utf8');
    return new Uint8Array(b.buffer, b.byteOffset, b.byteLength);
  }

  /** The same ids widened to int32 (for tensors and APIs that mix tokenizers). */
  encodeInt32(text: string): Int32Array {
    return Int32Array.from(this.encode(text));
  }

  /**
   * Text from ids. Ids must lie in 0..255; a cut through a multi-byte character (e.g. in sampled
   * text) decodes to U+FFFD rather than throwing.
   */
  decode(ids: ArrayLike<number>): string {
    let bytes: Uint8Array;
    if (ids instanceof Uint8Array) {
      bytes = ids;
    } else {
      bytes = new Uint8Array(ids.length);
      for (let i = 0; i < ids.length; i++) {
        const v = ids[i]!;
        if (!Number.isInteger(v) || v < 0 || v > 255) {
          throw new RangeError(`ByteTokenizer.decode: id ${v} at position ${i} is outside the byte vocabulary 0..255`);
        }
        bytes[i] = v;
      }
    }
    return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString('utf8');
  }
}
