// Calls the Python panel API (mldebug.dap.panel) in the paused frame through DAP `evaluate`
// and returns its JSON parsed and typed. Knows DAP and Python, nothing of the webview.
//
// Context "clipboard", not "repl": debugpy 1.8 cuts repl/hover results longer than 2**16
// characters in the middle (pydevd_safe_repr maxstring_outer), which breaks a 256x256
// heatmap's JSON; the clipboard context returns the whole repr (checked with debugpy 1.8.22).
import { pythonStrLiteral, pythonStrValue } from './pyrepr';
import type { FrameTensors, GraphAnswer, PauseInfo, StopInfo, TensorRequest, TensorSlice } from './messages';

/** The part of vscode.DebugSession this module uses (a stub in tests). */
export interface DapSession {
  customRequest(command: string, args?: unknown): Thenable<unknown>;
}

export const PANEL_MODULE = "__import__('mldebug.dap.panel', fromlist=['_'])";
export const MAX_SIDE = 256;

export const expressions = {
  stop: (): string => `${PANEL_MODULE}.stop_json()`,
  frame: (): string => `${PANEL_MODULE}.frame_json(locals())`,
  tensor: (r: TensorRequest, maxSide: number = MAX_SIDE): string => (r.node !== undefined
    ? `${PANEL_MODULE}.node_tensor_json(${pythonStrLiteral(r.node)}, `
    : `${PANEL_MODULE}.tensor_json((${r.expr}), name=${pythonStrLiteral(r.expr)}, `)
    + `dims=${pyIntList(r.dims)}, index=${pyIntList(r.index)}, grad=${r.grad ? 'True' : 'False'}, max_side=${maxSide})`,
  /** The graph with EXPANDED open; MARK also opens the path to what is marked (a new stop). */
  graph: (expanded: readonly string[] | null, mark: boolean): string =>
    `${PANEL_MODULE}.graph_json(${expanded ? `[${expanded.map(pythonStrLiteral).join(', ')}]` : 'None'}, `
    + `mark=${mark ? 'True' : 'False'})`,
  view: (): string => "__import__('mldebug').view()",
};

function pyIntList(values: readonly (number | null)[] | null | undefined): string {
  return values ? `[${values.map((v) => (v === null ? 'None' : String(Math.trunc(v)))).join(', ')}]` : 'None';
}

/** A failure the Python side reported as `{"error": ...}`, or an evaluate that failed. */
export class PanelApiError extends Error {}

interface EvaluateBody { result?: unknown }
interface StackTraceBody { stackFrames?: { id: number; name?: string; line?: number; source?: { path?: string } }[] }

/** Evaluate EXPRESSION in frame FRAMEID and return the str it yields, unquoted. */
export async function evaluateStr(session: DapSession, expression: string, frameId: number): Promise<string> {
  let body: EvaluateBody;
  try {
    body = (await session.customRequest('evaluate', { expression, frameId, context: 'clipboard' })) as EvaluateBody;
  } catch (e) {
    throw new PanelApiError(e instanceof Error ? e.message : String(e));
  }
  return pythonStrValue(String(body?.result ?? ''));
}

/** Evaluate a panel API call and parse its JSON; `{"error": ...}` becomes a PanelApiError. */
export async function evaluateJson<T>(session: DapSession, expression: string, frameId: number): Promise<T> {
  const text = await evaluateStr(session, expression, frameId);
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    throw new PanelApiError(`not JSON: ${text.slice(0, 200)}`);
  }
  if (typeof value === 'object' && value !== null && 'error' in value) {
    throw new PanelApiError(String((value as { error: unknown }).error));
  }
  return value as T;
}

/** The top frame of THREADID: its id and where it is. */
export async function topFrame(session: DapSession, threadId: number): Promise<{ id: number; pause: Omit<PauseInfo, 'reason'> } | undefined> {
  const body = (await session.customRequest('stackTrace', { threadId, startFrame: 0, levels: 1 })) as StackTraceBody;
  const frame = body?.stackFrames?.[0];
  return frame ? { id: frame.id, pause: { file: frame.source?.path, line: frame.line, function: frame.name } } : undefined;
}

export async function stopInfo(session: DapSession, frameId: number): Promise<StopInfo | null> {
  return (await evaluateJson<{ stop: StopInfo | null }>(session, expressions.stop(), frameId)).stop;
}

export async function frameTensors(session: DapSession, frameId: number): Promise<FrameTensors> {
  const frame = await evaluateJson<FrameTensors>(session, expressions.frame(), frameId);
  return { tensors: frame.tensors ?? [], truncated: frame.truncated ?? 0 };
}

export async function tensorSlice(session: DapSession, request: TensorRequest, frameId: number): Promise<TensorSlice> {
  return evaluateJson<TensorSlice>(session, expressions.tensor(request), frameId);
}

/** The browser view's URL, or undefined when this mldebug has no view. */
export async function browserViewUrl(session: DapSession, frameId: number): Promise<string | undefined> {
  try {
    const url = (await evaluateStr(session, expressions.view(), frameId)).trim();
    return /^https?:\/\//.test(url) ? url : undefined;
  } catch {
    return undefined;
  }
}

/** The graph of the last forward pass (`{graph: null, note}` when there is none). */
export async function graphAnswer(session: DapSession, expanded: readonly string[] | null, mark: boolean,
  frameId: number): Promise<GraphAnswer> {
  const answer = await evaluateJson<GraphAnswer>(session, expressions.graph(expanded, mark), frameId);
  return { graph: answer.graph ?? null, note: answer.note };
}
