// The heatmap of a 2-D tensor slice: one pixel per cell (the canvas is scaled up by CSS,
// pixelated), finite values on a viridis ramp between the slice's min and max, NaN and
// +/-Inf in colours of their own; and which tensor element a pixel stands for.
import type { NonFinite, TensorSlice } from '../messages';
import { formatNumber } from './model';

export type Rgb = readonly [number, number, number];

/** On-screen size limit of one cell (a 2x2 tensor need not fill the panel). */
const MAX_CELL_CSS = 40;

/** Colours of the non-finite values; none of them is on the viridis ramp. */
export const NONFINITE_COLOURS: Record<NonFinite, Rgb> = {
  nan: [255, 0, 255],      // magenta
  inf: [255, 40, 40],      // red
  '-inf': [0, 230, 255],   // cyan
};
export const NONFINITE_LABELS: Record<NonFinite, string> = { nan: 'NaN', inf: '+Inf', '-inf': '-Inf' };

const VIRIDIS: readonly Rgb[] = [
  [68, 1, 84], [72, 40, 120], [62, 74, 137], [49, 104, 142], [38, 130, 142],
  [31, 158, 137], [53, 183, 121], [110, 206, 88], [181, 222, 43], [253, 231, 37],
];

/** Viridis at T in [0, 1]. */
export function viridis(t: number): Rgb {
  const x = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  const a = VIRIDIS[i];
  const b = VIRIDIS[i + 1];
  const mix = (k: 0 | 1 | 2): number => Math.round(a[k] + (b[k] - a[k]) * f);
  return [mix(0), mix(1), mix(2)];
}

export function cssColour(rgb: Rgb): string {
  return `rgb(${rgb[0]}, ${rgb[1]}, ${rgb[2]})`;
}

/** Kind of each non-finite cell, keyed "row,col". A null cell not listed counts as NaN. */
function nonfiniteCells(slice: TensorSlice): Map<string, NonFinite> {
  return new Map((slice.nonfinite ?? []).map(([r, c, kind]) => [`${r},${c}`, kind]));
}

export function sliceSize(slice: TensorSlice): { rows: number; cols: number } {
  const rows = slice.data.length;
  return { rows, cols: rows ? Math.max(...slice.data.map((row) => row.length)) : 0 };
}

/** RGBA pixels of the slice, row-major, one per cell. */
export function sliceRgba(slice: TensorSlice): Uint8ClampedArray<ArrayBuffer> {
  const { rows, cols } = sliceSize(slice);
  const pixels = new Uint8ClampedArray(rows * cols * 4);
  const bad = nonfiniteCells(slice);
  const finite = slice.data.flat().filter((v): v is number => v !== null && Number.isFinite(v));
  const lo = slice.min !== null && Number.isFinite(slice.min) ? slice.min : Math.min(...finite);
  const hi = slice.max !== null && Number.isFinite(slice.max) ? slice.max : Math.max(...finite);
  const span = hi > lo ? hi - lo : 1;
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      const v = slice.data[r][c];
      const rgb = v === null || v === undefined || !Number.isFinite(v)
        ? NONFINITE_COLOURS[bad.get(`${r},${c}`) ?? kindOf(v)]
        : viridis((v - lo) / span);
      pixels.set([rgb[0], rgb[1], rgb[2], 255], (r * cols + c) * 4);
    }
  }
  return pixels;
}

function kindOf(v: number | null | undefined): NonFinite {
  return typeof v === 'number' && v === Infinity ? 'inf' : typeof v === 'number' && v === -Infinity ? '-inf' : 'nan';
}

/** Paint SLICE into CANVAS (one pixel per cell) and size it on screen. */
export function drawHeatmap(canvas: HTMLCanvasElement, slice: TensorSlice, maxCss = 512): void {
  const { rows, cols } = sliceSize(slice);
  canvas.width = Math.max(1, cols);
  canvas.height = Math.max(1, rows);
  const ctx = canvas.getContext('2d');
  if (!ctx || !rows || !cols) {
    return;
  }
  ctx.putImageData(new ImageData(sliceRgba(slice), cols, rows), 0, 0);
  const scale = Math.max(1, Math.min(MAX_CELL_CSS, Math.floor(maxCss / Math.max(rows, cols))));
  canvas.style.width = `${cols * scale}px`;
  canvas.style.height = `${rows * scale}px`;
}

function strides(slice: TensorSlice): [number, number] {
  const s = slice.stride;
  return Array.isArray(s) ? [s[0] ?? 1, s[1] ?? s[0] ?? 1] : [s || 1, s || 1];
}

/** The tensor element under cell (ROW, COL) of the slice: its full index and its value. */
export function cellInfo(slice: TensorSlice, row: number, col: number): { index: number[]; value: string } {
  const [sr, sc] = strides(slice);
  const ndim = slice.shape.length;
  const index = Array.from({ length: ndim }, (_, d) => slice.index?.[d] ?? 0);
  // dims: [row dim, col dim]; a 1-D tensor is one row ([null, 0]), a 0-d one cell
  const [rowDim, colDim] = slice.dims ?? (ndim >= 2 ? [ndim - 2, ndim - 1] : [null, ndim === 1 ? 0 : null]);
  if (typeof rowDim === 'number') {
    index[rowDim] = row * sr;
  }
  if (typeof colDim === 'number') {
    index[colDim] = col * sc;
  }
  const v = slice.data[row]?.[col];
  const bad = nonfiniteCells(slice).get(`${row},${col}`);
  const value = bad ? NONFINITE_LABELS[bad] : v === null || v === undefined ? 'NaN' : formatNumber(v);
  return { index, value };
}
