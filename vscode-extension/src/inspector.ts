// What the Tensors panel shows for the current pause: on every stop it asks the Python panel
// API for the stop, the frame's tensors and the graph of the last forward pass and posts
// them; it answers the panel's requests for one tensor (a graph node's output too) and for the
// graph with other modules open; it remembers the last messages so a new or reloaded panel is
// filled at once.
// Knows DAP sessions (through DapSession) and the message types, not the webview's DOM.
import * as api from './panelApi';
import type { GraphAnswer, PauseInfo, StopInfo, TensorRequest, ToWebview } from './messages';

export interface InspectorSession extends api.DapSession {
  readonly id: string;
}

/** Where posted messages go: the Tensors panel. */
export interface PanelSink {
  post(message: ToWebview): void;
}

/** The panel, if one is open, or a new or revealed one. */
export interface PanelHost {
  current(): PanelSink | undefined;
  show(): PanelSink;
}

export interface StoppedBody {
  reason: string;
  threadId?: number;
  description?: string;
  text?: string;
}

/** DAP stop reasons that are a plain pause, never an mldebug stop. */
const PLAIN_DAP_REASONS: ReadonlySet<string> = new Set(['breakpoint', 'step', 'pause', 'entry', 'goto', 'function breakpoint', 'data breakpoint', 'instruction breakpoint']);

function sameLine(file: string | undefined | null, line: number | undefined | null, pause: PauseInfo): boolean {
  const base = (p: string): string => p.split(/[\\/]/).pop() ?? p;
  return Boolean(file && line && pause.file && pause.line === line && base(pause.file) === base(file));
}

/**
 * The mldebug stop that explains this pause, or null. `stop_json()` returns the session's
 * LAST stop, which is stale at a later breakpoint: trust the `mldebug.stop` event sent
 * just before this pause, else a stop_json() stop only for an exception-like pause at its line.
 */
export function currentStop(fromApi: StopInfo | null, pause: PauseInfo, fromEvent?: StopInfo): StopInfo | null {
  if (fromEvent) {
    return fromEvent;
  }
  if (!fromApi || PLAIN_DAP_REASONS.has(pause.reason)) {
    return null;
  }
  if (pause.line === undefined || sameLine(fromApi.file, fromApi.line, pause) || sameLine(fromApi.pause_file, fromApi.pause_line, pause)) {
    return fromApi;
  }
  return null;
}

const PENDING_RETRIES = 5;
const PENDING_RETRY_MS = 400;

interface Paused {
  session: InspectorSession;
  threadId: number;
  frameId: number;
  pause: PauseInfo;
}

export class Inspector {
  private paused: Paused | undefined;
  private generation = 0;
  /** `mldebug.stop` events received since each session last ran, by session id. */
  private readonly announced = new Map<string, StopInfo>();
  private readonly last = new Map<ToWebview['command'], ToWebview>();
  /** The graph's open modules, kept from stop to stop (ids are stable across passes). */
  private graphExpanded: string[] | null = null;

  constructor(private readonly panels: PanelHost, private readonly log: (line: string) => void = () => undefined) {}

  /** The frame the panel describes (the top frame of the last stop). */
  get pausedFrame(): { session: InspectorSession; frameId: number } | undefined {
    return this.paused && { session: this.paused.session, frameId: this.paused.frameId };
  }

  async onStopped(session: InspectorSession, body: StoppedBody): Promise<void> {
    const generation = ++this.generation;
    const threadId = body.threadId ?? 1;
    const frame = await api.topFrame(session, threadId).catch(() => undefined);
    if (generation !== this.generation) {
      return;
    }
    const pause: PauseInfo = { reason: body.reason, description: body.description ?? body.text, ...frame?.pause };
    if (!frame) {
      this.post({ command: 'stop', stop: null, pause });
      return;
    }
    this.paused = { session, threadId, frameId: frame.id, pause };
    await this.describeFrame(session, frame.id, pause, generation);
  }

  /** The user selected another frame of the paused thread: show its tensors. */
  async selectFrame(session: InspectorSession, frameId: number): Promise<void> {
    const paused = this.paused;
    if (!paused || paused.session.id !== session.id || paused.frameId === frameId) {
      return;
    }
    this.paused = { ...paused, frameId };
    await this.describeFrame(session, frameId, paused.pause);
  }

  /** The custom event mldebug sends just before it pauses for a stop. */
  onStopEvent(session: InspectorSession, stop: StopInfo): void {
    this.announced.set(session.id, stop);
  }

  /** Fill the panel for FRAMEID: the stop banner, then the frame's tensors. */
  async describeFrame(session: InspectorSession, frameId: number, pause: PauseInfo, generation = ++this.generation): Promise<void> {
    const fromApi = await api.stopInfo(session, frameId).catch((e: unknown) => {
      this.log(`stop_json failed: ${errorText(e)}`);
      return null;
    });
    const stop = currentStop(fromApi, pause, this.announced.get(session.id));
    if (generation !== this.generation) {
      return;
    }
    this.post({ command: 'stop', stop, pause });
    const pending = await this.describeTensors(session, frameId, generation);
    await this.describeGraph(session, frameId, generation);
    // Summaries of huge tensors come `pending`: ask again a few times while still paused here.
    for (let attempt = 0; pending && generation === this.generation && attempt < PENDING_RETRIES; attempt++) {
      await new Promise((resolve) => setTimeout(resolve, PENDING_RETRY_MS));
      if (generation !== this.generation || !(await this.describeTensors(session, frameId, generation))) {
        return;
      }
    }
  }

  /** Post the frame's tensors; true when some summary is still pending. */
  private async describeTensors(session: InspectorSession, frameId: number, generation: number): Promise<boolean> {
    try {
      const frame = await api.frameTensors(session, frameId);
      if (generation !== this.generation) {
        return false;
      }
      this.post({ command: 'tensors', tensors: frame.tensors, truncated: frame.truncated });
      return frame.tensors.some((t) => t.pending);
    } catch (e) {
      if (generation === this.generation) {
        this.post({ command: 'error', message: `Tensors of this frame are not available: ${errorText(e)}` });
      }
      return false;
    }
  }

  /** Post the graph of the last pass: the modules open before stay open, and the path to
   *  what is marked opens (the view does the same for a new pass). */
  private async describeGraph(session: InspectorSession, frameId: number, generation: number): Promise<void> {
    try {
      const answer = await api.graphAnswer(session, this.graphExpanded, true, frameId);
      if (generation === this.generation) {
        this.postGraph(answer);
      }
    } catch (e) {
      this.log(`graph_json failed: ${errorText(e)}`);
      if (generation === this.generation) {
        this.post({ command: 'graph', graph: null, note: `The graph is not available: ${errorText(e)}` });
      }
    }
  }

  /** The panel opened or closed a module of the graph: draw it again with EXPANDED open. */
  async requestGraph(expanded: string[], where = this.pausedFrame): Promise<void> {
    if (!where) {
      this.post({ command: 'error', message: 'Not paused: the graph can change only at a stop.' });
      return;
    }
    try {
      this.postGraph(await api.graphAnswer(where.session, expanded, false, where.frameId));
    } catch (e) {
      this.post({ command: 'error', message: `Cannot draw the graph: ${errorText(e)}` });
    }
  }

  private postGraph(answer: GraphAnswer): void {
    if (answer.graph) {
      this.graphExpanded = answer.graph.expanded;
    }
    this.post({ command: 'graph', graph: answer.graph, note: answer.note });
  }

  /** Show one tensor: REQUEST evaluated in the given frame, else in the paused frame. */
  async requestTensor(request: TensorRequest, where = this.pausedFrame): Promise<void> {
    if (!where) {
      this.post({ command: 'error', message: 'Not paused: start an mldebug session and stop somewhere.' });
      return;
    }
    try {
      const slice = await api.tensorSlice(where.session, request, where.frameId);
      this.post({ command: 'tensor', slice, request });
    } catch (e) {
      this.post({ command: 'error', message: `Cannot show ${request.expr}: ${errorText(e)}` });
    }
  }

  running(session: InspectorSession): void {
    this.announced.delete(session.id);
    if (this.paused?.session.id === session.id) {
      this.paused = undefined;
      this.generation++;
      this.post({ command: 'running' }, false);
    }
  }

  ended(session: InspectorSession): void {
    this.announced.delete(session.id);
    this.graphExpanded = null;
    if (!this.paused || this.paused.session.id === session.id) {
      this.paused = undefined;
      this.generation++;
      this.post({ command: 'ended' }, false);
    }
  }

  /** Send the last stop, tensors and slice again (a panel that was just created or reloaded). */
  replay(sink: PanelSink): void {
    for (const message of this.last.values()) {
      sink.post(message);
    }
  }

  private post(message: ToWebview, reveal = true): void {
    if (message.command === 'stop' || message.command === 'running' || message.command === 'ended') {
      this.last.clear();
    }
    if (message.command !== 'error') {
      this.last.set(message.command, message);
    }
    // A stop opens the panel; running/ended only update one that is open.
    (reveal ? this.panels.show() : this.panels.current())?.post(message);
  }
}

function errorText(e: unknown): string {
  return e instanceof Error ? e.message : String(e);
}
