// The one definition of what crosses between the extension and the Tensors panel page:
// the JSON shapes returned by the Python panel API (mldebug.dap.panel) and the two
// `command` unions posted with `postMessage`. Imported by both sides; no runtime code
// besides the type guards at the bottom.

// ---- the Python panel API (mldebug.dap.panel), each call returns one JSON string -------

/** One pause as mldebug describes it (`stop_json()["stop"]`); the same fields as its `Stop`. */
export interface StopInfo {
  reason: string;              // "nan", "inf", "assert", "exception", "breakpoint", ...
  message?: string | null;
  file?: string | null;
  line?: number | null;
  function?: string | null;
  stage?: string | null;       // "forward", "backward", "optimizer"
  op?: string | null;          // "aten.log.default"
  module?: string | null;      // dotted module path, e.g. "encoder.layers.0.attn"
  assertion?: string | null;
  step?: number | null;
  pause_file?: string;         // where the debugger paused, when it differs from file:line
  pause_line?: number;
  data?: DataOrigin | null;    // the sample a NaN/Inf came in with
  rank?: number | null;        // the rank of a multi-process job that stopped
  hint?: string | null;        // the likely cause and its usual fix, "" when none is known
  cause?: string | null;       // the name of the catalogue's rule behind `hint`
  [extra: string]: unknown;
}

/** The report's `data` key: the batch variable, its bad rows and their dataset indices. */
export interface DataOrigin {
  variable?: string | null;            // "x", "batch['pixel_values']"
  rows?: number[] | null;
  dataset_indices?: number[] | null;
}

/** What `summary` holds for one tensor: mldebug.summary.TensorSummary.to_dict(). */
export interface TensorSummary {
  kind?: string;               // "tensor", "ndarray", or the type name of something else
  shape?: number[];
  dtype?: string;              // short: "f32", "bf16", "i64"
  device?: string;
  numel?: number;
  requires_grad?: boolean;
  min?: number | null;         // min/max/mean/std of the finite values
  max?: number | null;
  mean?: number | null;
  std?: number | null;
  nan?: number;
  posinf?: number;
  neginf?: number;
  zeros?: number;
  hist?: number[] | null;
  hist_range?: [number, number] | null;
  note?: string;
  grad?: TensorSummary | null;
  [extra: string]: unknown;
}

/** One tensor of the paused frame (`frame_json()["tensors"][i]`). */
export interface TensorEntry {
  name: string;                // "x", "batch[0]", "out['logits']"
  line: string;                // the one-line summary, lovely-tensors style
  summary: TensorSummary;
  pending?: boolean;           // summary still being computed (a huge tensor): ask again
}

/** `frame_json(locals())`: the tensors, and how many more there were than the limit. */
export interface FrameTensors {
  tensors: TensorEntry[];
  truncated?: number;
}

/** A 2-D slice of one tensor, downsampled to at most max_side per side (`tensor_json()`). */
export interface TensorSlice {
  name: string;                // "w", or "w.grad" for the gradient
  shape: number[];
  dtype: string;
  dims: (number | null)[] | null;   // [row dim, col dim]; 1-D: [null, 0]; 0-d: [null, null]
  index: (number | null)[] | null;  // one entry per dim, null at the shown dims
  rows: number;                // display rows (after downsampling)
  cols: number;                // display columns
  stride: number | number[];   // downsampling step: [row, col] (or one for both)
  data: (number | null)[][];   // null where the cell is NaN/Inf (see nonfinite)
  nonfinite: [number, number, NonFinite][];   // display cells, possibly capped
  nonfinite_total?: number;
  min: number | null;          // finite values of the slice
  max: number | null;
  summary: TensorSummary | string;   // of the whole tensor
  hist: { counts: number[]; range: [number, number] | null } | null;
  image: { width: number; height: number; channels?: number; png_base64: string } | null;
  block_mean?: boolean;        // downsampled cells are block means
  sampled?: boolean;           // min/max/hist of a strided sample of a huge slice
  pending?: boolean;
}
export type NonFinite = 'nan' | 'inf' | '-inf';

/** The graph of the last forward pass (`graph_json()["graph"]`): the browser view's graph
 *  figure as a standalone Bokeh document, drawn in the page by the program's own BokehJS. */
export interface GraphPayload {
  item: unknown;               // bokeh.embed.json_item of the figure: {doc, root_id, target_id, version}
  note: string;                // "4 module calls"
  expanded: string[];          // node ids shown open
  marked: string[];            // NaN/Inf, violation, failing module calls: "head#0"
  modules: number;
  bokeh: { version: string; js: string[] };   // absolute paths of the BokehJS files
}

/** `graph_json()`: the graph, or null with why. */
export interface GraphAnswer {
  graph: GraphPayload | null;
  note?: string;
}

/** What the extension asks `tensor_json` for. */
export interface TensorRequest {
  expr: string;                // a Python expression valid in the paused frame
                               // (for a graph node: its label, shown only)
  node?: string;               // a graph node's id ("head#0"): its output via node_tensor_json
  dims?: [number, number] | null;
  index?: (number | null)[] | null;
  grad?: boolean;              // show expr.grad instead
}

/** The DAP `stopped` event body, kept for a banner when mldebug says nothing (plain pause). */
export interface PauseInfo {
  reason: string;              // DAP reason: "breakpoint", "step", "exception", "pause", ...
  description?: string;
  file?: string;
  line?: number;
  function?: string;
}

// ---- extension -> webview -----------------------------------------------------------------

export type ToWebview =
  | { command: 'stop'; stop: StopInfo | null; pause: PauseInfo }
  | { command: 'tensors'; tensors: TensorEntry[]; truncated?: number }
  | { command: 'tensor'; slice: TensorSlice; request: TensorRequest }
  | { command: 'graph'; graph: GraphPayload | null; note?: string }
  | { command: 'error'; message: string }
  | { command: 'running' }
  | { command: 'ended' };

// ---- webview -> extension -----------------------------------------------------------------

export type FromWebview =
  | { command: 'ready' }
  | { command: 'requestTensor'; request: TensorRequest }
  | { command: 'requestGraph'; expanded: string[] };

// ---- guards for messages arriving untyped ----------------------------------------------------

const TO_WEBVIEW: ReadonlySet<string> = new Set<ToWebview['command']>(['stop', 'tensors', 'tensor', 'graph', 'error', 'running', 'ended']);
const FROM_WEBVIEW: ReadonlySet<string> = new Set<FromWebview['command']>(['ready', 'requestTensor', 'requestGraph']);

function hasCommand(value: unknown): value is { command: string } {
  return typeof value === 'object' && value !== null && typeof (value as { command?: unknown }).command === 'string';
}

export function isToWebview(value: unknown): value is ToWebview {
  return hasCommand(value) && TO_WEBVIEW.has(value.command);
}

export function isFromWebview(value: unknown): value is FromWebview {
  return hasCommand(value) && FROM_WEBVIEW.has(value.command);
}
