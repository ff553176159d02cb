// The Tensors panel's state and how each message from the extension changes it: pure
// functions, no DOM (test/model.test.ts runs them in Node). The state is what the page
// saves with setState, so it must stay plain JSON.
import type { DataOrigin, GraphPayload, PauseInfo, StopInfo, TensorEntry, TensorRequest, TensorSlice, TensorSummary, ToWebview } from '../messages';

export type BannerKind = 'idle' | 'stop' | 'paused' | 'running' | 'ended';

export interface Banner {
  kind: BannerKind;
  title: string;
  details: string[];           // "op aten.log.default", "module encoder.fc", "train.py:12", ...
  message?: string;
  hint?: string;               // the likely cause and its fix (the stop's `hint`)
}

export interface PanelState {
  banner: Banner;
  tensors: TensorEntry[];
  truncated: number;               // tensors of the frame not listed
  slice: TensorSlice | null;
  request: TensorRequest | null;   // the tensor shown (or asked for), re-asked at each stop
  stale: boolean;                  // the slice is from an earlier stop
  error: string | null;
  graph: GraphPayload | null;      // the graph of the last forward pass, drawn by BokehJS
  graphNote: string;               // why there is no graph, or how many module calls
}

export const INITIAL_STATE: PanelState = {
  banner: { kind: 'idle', title: 'Not paused', details: [] },
  tensors: [],
  truncated: 0,
  slice: null,
  request: null,
  stale: false,
  error: null,
  graph: null,
  graphNote: '',
};

const REASON_TITLES: Record<string, string> = {
  nan: 'NaN', inf: 'Inf', 'inf-all': 'Inf', nonfinite: 'NaN/Inf', assert: 'Assertion failed',
  assertion: 'Assertion failed', exception: 'Exception',
};
/** mldebug reasons that are no more than a pause (a breakpoint, a step). */
const PLAIN_PAUSES: ReadonlySet<string> = new Set(['breakpoint', 'step', 'pause', 'entry', 'start', 'goto']);

export function basename(path: string): string {
  return path.split(/[\\/]/).pop() ?? path;
}

function where(file?: string | null, line?: number | null, fn?: string | null): string | undefined {
  if (!file) {
    return undefined;
  }
  const at = line ? `${basename(file)}:${line}` : basename(file);
  return fn && fn !== '<module>' ? `${at} in ${fn}` : at;
}

/** The banner for a stop: mldebug's own description when it has one, else "Paused". */
export function bannerFor(stop: StopInfo | null, pause: PauseInfo): Banner {
  if (stop && !PLAIN_PAUSES.has(stop.reason)) {
    const details = [
      stop.op ? `op ${stop.op}` : undefined,
      stop.module ? `module ${stop.module}` : undefined,
      where(stop.file, stop.line, stop.function),
      stop.stage && stop.stage !== 'other' ? `stage ${stop.stage}` : undefined,
      stop.step !== undefined && stop.step !== null ? `step ${stop.step}` : undefined,
      stop.assertion ? `assertion ${stop.assertion}` : undefined,
      stop.data ? `data ${dataText(stop.data)}` : undefined,
      typeof stop.rank === 'number' ? `rank ${stop.rank}` : undefined,
    ].filter((d): d is string => Boolean(d));
    const title = `Stopped: ${REASON_TITLES[stop.reason] ?? stop.reason}`;
    const hint = stop.hint || undefined;
    // the message ends with the hint: the banner shows it once, on its own line
    const message = hint ? stop.message?.replace(`; hint: ${hint}`, '') : stop.message;
    return { kind: 'stop', title, details, message: message ?? undefined, hint };
  }
  const file = stop?.file || pause.file;
  const line = stop?.line || pause.line;
  const details = [where(file, line, stop?.function || pause.function)].filter((d): d is string => Boolean(d));
  const reason = stop?.reason ?? pause.reason;
  const title = PLAIN_PAUSES.has(reason) ? 'Paused' : `Paused (${reason})`;
  return { kind: 'paused', title, details, message: stop?.message ?? pause.description ?? undefined };
}

/** "x row 7 (dataset index 77)", as mldebug's own line says it (core/records.py). */
export function dataText(data: DataOrigin): string {
  const few = (values: number[]) => values.slice(0, 5).join(', ')
    + (values.length > 5 ? ` and ${values.length - 5} more` : '');
  let text = data.variable || 'the batch';
  if (data.rows && data.rows.length) {
    text += ` ${data.rows.length === 1 ? 'row' : 'rows'} ${few(data.rows)}`;
  }
  const indices = data.dataset_indices;
  if (indices && indices.length) {
    text += ` (${indices.length === 1 ? 'dataset index' : 'dataset indices'} ${few(indices)})`;
  }
  return text;
}

/** The banner as one line of text. */
export function bannerText(banner: Banner): string {
  const hint = banner.hint ? `Hint: ${banner.hint}` : undefined;
  return [banner.title, ...banner.details, banner.message, hint].filter(Boolean).join(' \u2014 ');
}

export function reduce(state: PanelState, message: ToWebview): PanelState {
  switch (message.command) {
    case 'stop':
      return { ...state, banner: bannerFor(message.stop, message.pause), error: null, stale: state.slice !== null };
    case 'tensors':
      return { ...state, tensors: message.tensors, truncated: message.truncated ?? 0 };
    case 'tensor':
      return { ...state, slice: message.slice, request: message.request, stale: false, error: null };
    case 'graph':
      return { ...state, graph: message.graph, graphNote: message.graph?.note ?? message.note ?? '' };
    case 'error':
      return { ...state, error: message.message };
    case 'running':
      return { ...state, banner: { kind: 'running', title: 'Running\u2026', details: [] }, error: null };
    case 'ended':
      return { ...INITIAL_STATE, banner: { kind: 'ended', title: 'Session ended', details: [] } };
  }
}

/** After a new stop's tensors arrive: the tensor shown before, if this frame has it too. */
export function requestToRepeat(state: PanelState): TensorRequest | null {
  const request = state.request;
  return state.stale && request && state.tensors.some((t) => t.name === request.expr) ? request : null;
}

/** A one-line summary built from the fields, when mldebug's own line is not at hand. */
export function formatSummary(s: TensorSummary): string {
  const parts = [`${s.kind ?? 'tensor'}[${(s.shape ?? []).join(', ')}]`, s.dtype ?? ''];
  if (s.device && s.device !== 'cpu') {
    parts.push(s.device);
  }
  if (s.min !== null && s.min !== undefined) {
    parts.push(`x\u2208[${formatNumber(s.min)}, ${formatNumber(s.max)}]`);
  }
  if (s.mean !== null && s.mean !== undefined) {
    parts.push(`\u03bc=${formatNumber(s.mean)}`);
  }
  if (s.std !== null && s.std !== undefined) {
    parts.push(`\u03c3=${formatNumber(s.std)}`);
  }
  if (s.nan) {
    parts.push(`NaN\u00d7${s.nan}`);
  }
  if (s.posinf) {
    parts.push(`+Inf\u00d7${s.posinf}`);
  }
  if (s.neginf) {
    parts.push(`-Inf\u00d7${s.neginf}`);
  }
  return parts.filter(Boolean).join(' ');
}

/** The summary line shown above a slice: the frame list's line for it, else built. */
export function sliceSummary(state: PanelState): string {
  const slice = state.slice;
  if (!slice) {
    return '';
  }
  const listed = state.tensors.find((t) => t.name === slice.name);
  if (listed) {
    return listed.line;
  }
  return typeof slice.summary === 'string' ? slice.summary : formatSummary(slice.summary ?? {});
}

/** A number as the panel prints it: short, and NaN/Inf spelled out. */
export function formatNumber(value: number | null | undefined): string {
  if (value === null || value === undefined) {
    return '\u2014';
  }
  if (!Number.isFinite(value)) {
    return Number.isNaN(value) ? 'NaN' : value > 0 ? '+Inf' : '-Inf';
  }
  if (value !== 0 && (Math.abs(value) >= 1e5 || Math.abs(value) < 1e-3)) {
    return value.toExponential(3);
  }
  return String(Number(value.toPrecision(4)));
}

/** The open set after a click on the toggle of node ID: open it, or close it. */
export function toggled(expanded: readonly string[], id: string): string[] {
  return expanded.includes(id) ? expanded.filter((e) => e !== id) : [...expanded, id];
}

/** The request for a graph node's output: its label (up to the type) is what the panel names. */
export function nodeRequest(id: string, label: string): TensorRequest {
  return { expr: label.split(' (')[0] || id, node: id };
}
