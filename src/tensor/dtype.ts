// Tensor element types and their c10::ScalarType codes.

export type DType = 'float32' | 'float64' | 'bfloat16' | 'float16' | 'int64' | 'int32' | 'int16' | 'int8' | 'uint8' | 'bool';

const CODES: Record<DType, number> = {
  uint8: 0, int8: 1, int16: 2, int32: 3, int64: 4, float16: 5, float32: 6, float64: 7, bool: 11, bfloat16: 15,
};
/** Every dtype flotilla has. */
export const DTYPES: readonly DType[] = Object.keys(CODES) as DType[];
const NAMES = new Map<number, DType>(Object.entries(CODES).map(([k, v]) => [v, k as DType]));

export function dtypeCode(d: DType): number {
  const c = CODES[d];
  if (c === undefined) throw new Error(`unknown dtype '${d}' (expected one of ${Object.keys(CODES).join(', ')})`);
  return c;
}

export function dtypeFromCode(c: number): DType {
  const d = NAMES.get(c);
  if (!d) throw new Error(`unsupported scalar type code ${c}`);
  return d;
}

export function isFloating(d: DType): boolean {
  return d === 'float32' || d === 'float64' || d === 'bfloat16' || d === 'float16';
}

export function elementSize(d: DType): number {
  switch (d) {
    case 'float64': case 'int64': return 8;
    case 'float32': case 'int32': return 4;
    case 'bfloat16': case 'float16': case 'int16': return 2;
    default: return 1;
  }
}

export type TypedArray =
  | Float32Array | Float64Array | BigInt64Array | Int32Array | Int16Array | Int8Array | Uint8Array | Uint16Array;

/** The typed array that holds a dtype's raw elements (bf16/f16 as raw Uint16). */
export function typedArrayFor(d: DType, buf: ArrayBuffer): TypedArray {
  switch (d) {
    case 'float32': return new Float32Array(buf);
    case 'float64': return new Float64Array(buf);
    case 'int64': return new BigInt64Array(buf);
    case 'int32': return new Int32Array(buf);
    case 'int16': return new Int16Array(buf);
    case 'int8': return new Int8Array(buf);
    case 'uint8': case 'bool': return new Uint8Array(buf);
    case 'bfloat16': case 'float16': return new Uint16Array(buf);
  }
}
