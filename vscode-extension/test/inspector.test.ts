// inspector.ts and panelApi.ts against a fake DAP session that answers like debugpy does
// (evaluate results are reprs): what reaches the panel on a stop, a request, a continue.
import { describe, it } from 'node:test';
import * as assert from 'node:assert/strict';
import * as stopFixture from './fixtures/stop.json';
import * as frameFixture from './fixtures/frame.json';
import * as sliceFixture from './fixtures/tensor_nan.json';
import { currentStop, Inspector, InspectorSession, PanelHost } from '../src/inspector';
import type { GraphPayload, StopInfo } from '../src/messages';
import { expressions, PANEL_MODULE } from '../src/panelApi';
import type { ToWebview } from '../src/messages';

/** Python's repr of a str, as debugpy returns it (enough of it for JSON text). */
function pyRepr(text: string): string {
  return `'${text.replace(/\\/g, '\\\\').replace(/'/g, "\\'")}'`;
}

interface Call { command: string; args: { expression?: string; frameId?: number; context?: string } }

function fakeSession(answers: Record<string, string | Error>): InspectorSession & { calls: Call[] } {
  const calls: Call[] = [];
  return {
    id: 's1',
    calls,
    async customRequest(command: string, args?: unknown) {
      calls.push({ command, args: args as Call['args'] });
      if (command === 'stackTrace') {
        return { stackFrames: [{ id: 7, name: '<module>', line: 6, source: { path: '/ws/nan_prog.py' } }] };
      }
      const expression = (args as Call['args']).expression ?? '';
      const key = Object.keys(answers).find((k) => expression.includes(k));
      const answer = key === undefined ? new Error(`NameError: ${expression}`) : answers[key];
      if (answer instanceof Error) {
        throw answer;
      }
      return { result: pyRepr(answer) };
    },
  };
}

function panelHost(): PanelHost & { posted: ToWebview[]; shown: number } {
  const host = {
    posted: [] as ToWebview[],
    shown: 0,
    current: () => host.shown ? sink : undefined,
    show: () => { host.shown++; return sink; },
  };
  const sink = { post: (m: ToWebview) => { host.posted.push(m); } };
  return host;
}

const GRAPH: GraphPayload = {
  item: { doc: {}, root_id: 'p1', target_id: null, version: '3.9.2' }, note: '4 module calls',
  expanded: ['root#0'], marked: ['head#0'], modules: 4, bokeh: { version: '3.9.2', js: ['/py/bokeh/server/static/js/bokeh.min.js'] },
};

const ANSWERS = {
  'stop_json()': JSON.stringify(stopFixture),
  'frame_json(locals())': JSON.stringify(frameFixture),
  'tensor_json(': JSON.stringify(sliceFixture),
  'graph_json(': JSON.stringify({ graph: GRAPH }),
};

describe('a stopped event', () => {
  it('posts the stop, the frame tensors and the graph, evaluated in the top frame', async () => {
    const session = fakeSession(ANSWERS);
    const host = panelHost();
    await new Inspector(host).onStopped(session, { reason: 'exception', threadId: 1 });
    assert.deepEqual(host.posted.map((m) => m.command), ['stop', 'tensors', 'graph']);
    assert.deepEqual(host.posted[2], { command: 'graph', graph: GRAPH, note: undefined });
    const stopMessage = host.posted[0];
    assert.ok(stopMessage.command === 'stop' && stopMessage.stop?.op === 'aten.sub.Tensor');
    assert.ok(stopMessage.command === 'stop' && stopMessage.pause.line === 6);
    const evaluates = session.calls.filter((c) => c.command === 'evaluate');
    assert.ok(evaluates.every((c) => c.args.frameId === 7 && c.args.context === 'clipboard'));
    assert.equal(evaluates[0].args.expression, `${PANEL_MODULE}.stop_json()`);
    assert.equal(evaluates[2].args.expression, `${PANEL_MODULE}.graph_json(None, mark=True)`);
  });

  it('still shows a plain pause when mldebug.dap.panel is missing', async () => {
    const host = panelHost();
    await new Inspector(host).onStopped(fakeSession({}), { reason: 'breakpoint', threadId: 1 });
    assert.deepEqual(host.posted.map((m) => m.command), ['stop', 'error', 'graph']);
    const first = host.posted[0];
    assert.ok(first.command === 'stop' && first.stop === null && first.pause.reason === 'breakpoint');
    const graph = host.posted[2];
    assert.ok(graph.command === 'graph' && graph.graph === null && /not available: NameError/.test(graph.note ?? ''));
  });

  it('turns {"error": ...} from Python into an error message', async () => {
    const host = panelHost();
    await new Inspector(host).onStopped(fakeSession({ ...ANSWERS, 'frame_json(locals())': '{"error": "no torch"}' }), { reason: 'exception', threadId: 1 });
    const error = host.posted.find((m) => m.command === 'error');
    assert.ok(error?.command === 'error' && error.message.includes('no torch'));
  });
});

describe('a tensor request', () => {
  it('evaluates tensor_json with the expression, dims, index and grad', async () => {
    const session = fakeSession(ANSWERS);
    const host = panelHost();
    const inspector = new Inspector(host);
    await inspector.onStopped(session, { reason: 'exception', threadId: 1 });
    await inspector.requestTensor({ expr: 'model.fc.weight', dims: [0, 2], index: [0, 3, 0], grad: true });
    const last = host.posted[host.posted.length - 1];
    assert.ok(last.command === 'tensor' && last.slice.nonfinite.length === 3);
    assert.deepEqual(last.command === 'tensor' && last.request, { expr: 'model.fc.weight', dims: [0, 2], index: [0, 3, 0], grad: true });
    const expression = session.calls[session.calls.length - 1].args.expression;
    assert.equal(expression, expressions.tensor({ expr: 'model.fc.weight', dims: [0, 2], index: [0, 3, 0], grad: true }));
    assert.match(expression ?? '', /tensor_json\(\(model\.fc\.weight\), name="model\.fc\.weight", dims=\[0, 2\], index=\[0, 3, 0\], grad=True, max_side=256\)$/);
  });

  it('says so when not paused', async () => {
    const host = panelHost();
    await new Inspector(host).requestTensor({ expr: 'x' });
    assert.ok(host.posted[0].command === 'error' && /Not paused/.test(host.posted[0].message));
  });

  it('asks node_tensor_json for a graph node, by its id, with dims, index and grad', async () => {
    const session = fakeSession({ ...ANSWERS, 'node_tensor_json(': JSON.stringify(sliceFixture) });
    const host = panelHost();
    const inspector = new Inspector(host);
    await inspector.onStopped(session, { reason: 'exception', threadId: 1 });
    const request = { expr: 'head', node: 'head#0', dims: [0, 1] as [number, number], index: [null, null], grad: true };
    await inspector.requestTensor(request);
    const last = host.posted[host.posted.length - 1];
    assert.ok(last.command === 'tensor');
    assert.deepEqual(last.request, request);
    assert.equal(session.calls[session.calls.length - 1].args.expression,
      `${PANEL_MODULE}.node_tensor_json("head#0", dims=[0, 1], index=[None, None], grad=True, max_side=256)`);
  });
});

describe('a graph request', () => {
  it('draws exactly the open set asked for, and the next stop keeps it open and opens the marks', async () => {
    const session = fakeSession(ANSWERS);
    const host = panelHost();
    const inspector = new Inspector(host);
    await inspector.onStopped(session, { reason: 'exception', threadId: 1 });
    await inspector.requestGraph(['root#0', "it's#0"]);
    const expression = () => session.calls[session.calls.length - 1].args.expression;
    assert.equal(expression(), `${PANEL_MODULE}.graph_json(["root#0", "it's#0"], mark=False)`);
    assert.equal(host.posted[host.posted.length - 1].command, 'graph');
    inspector.running(session);
    await inspector.onStopped(session, { reason: 'exception', threadId: 1 });
    // the answer said root#0 is open: that is what the next stop asks to keep
    assert.equal(expression(), `${PANEL_MODULE}.graph_json(["root#0"], mark=True)`);
    inspector.ended(session);
    await inspector.onStopped(session, { reason: 'exception', threadId: 1 });
    assert.equal(expression(), `${PANEL_MODULE}.graph_json(None, mark=True)`);
  });

  it('says so when not paused, and names a failed evaluate', async () => {
    const host = panelHost();
    const inspector = new Inspector(host);
    await inspector.requestGraph([]);
    assert.ok(host.posted[0].command === 'error' && /Not paused/.test(host.posted[0].message));
    const session = fakeSession({ ...ANSWERS, 'graph_json(': '{"error": "ModuleNotFoundError: bokeh"}' });
    await inspector.onStopped(session, { reason: 'exception', threadId: 1 });
    const graph = host.posted.find((m) => m.command === 'graph');
    assert.ok(graph?.command === 'graph' && graph.graph === null && /bokeh/.test(graph.note ?? ''));
    await inspector.requestGraph(['root#0']);
    const last = host.posted[host.posted.length - 1];
    assert.ok(last.command === 'error' && /Cannot draw the graph: ModuleNotFoundError: bokeh/.test(last.message));
  });
});

describe('continue and end', () => {
  it('marks the panel running, then ended, and replays the last state to a new page', async () => {
    const session = fakeSession(ANSWERS);
    const host = panelHost();
    const inspector = new Inspector(host);
    await inspector.onStopped(session, { reason: 'exception', threadId: 1 });
    const replayed: ToWebview[] = [];
    inspector.replay({ post: (m) => { replayed.push(m); } });
    assert.deepEqual(replayed.map((m) => m.command), ['stop', 'tensors', 'graph']);
    inspector.running(session);
    assert.equal(inspector.pausedFrame, undefined);
    inspector.ended(session);
    assert.deepEqual(host.posted.slice(-2).map((m) => m.command), ['running', 'ended']);
  });
});

describe('currentStop', () => {
  const stop = stopFixture.stop as StopInfo;
  const here = { reason: 'exception', file: '/other/root/nan_prog.py', line: 6 };
  it('trusts the mldebug.stop event sent before the pause', () => {
    assert.equal(currentStop(null, { reason: 'exception' }, stop), stop);
  });
  it('takes stop_json() at an exception pause on its line', () => {
    assert.equal(currentStop(stop, here), stop);
  });
  it('drops a stale stop at a later breakpoint or another line', () => {
    assert.equal(currentStop(stop, { ...here, reason: 'breakpoint' }), null);
    assert.equal(currentStop(stop, { ...here, line: 9 }), null);
    assert.equal(currentStop({ ...stop, pause_file: '/ws/nan_prog.py', pause_line: 9 }, { ...here, line: 9 })?.reason, 'nan');
  });
});

describe('the mldebug.stop event', () => {
  it('names the stop even when stop_json() fails, until the program runs again', async () => {
    const session = fakeSession({});
    const host = panelHost();
    const inspector = new Inspector(host);
    inspector.onStopEvent(session, stopFixture.stop as StopInfo);
    await inspector.onStopped(session, { reason: 'exception', threadId: 1 });
    const first = host.posted[0];
    assert.ok(first.command === 'stop' && first.stop?.reason === 'nan');
    inspector.running(session);
    await inspector.onStopped(session, { reason: 'breakpoint', threadId: 1 });
    const again = host.posted.find((m, i) => i > 0 && m.command === 'stop');
    assert.ok(again?.command === 'stop' && again.stop === null);
  });
});

describe('selecting another frame', () => {
  it('shows that frame\'s tensors and evaluates later requests there', async () => {
    const session = fakeSession(ANSWERS);
    const host = panelHost();
    const inspector = new Inspector(host);
    await inspector.onStopped(session, { reason: 'exception', threadId: 1 });
    await inspector.selectFrame(session, 9);
    assert.equal(inspector.pausedFrame?.frameId, 9);
    assert.deepEqual(host.posted.map((m) => m.command), ['stop', 'tensors', 'graph', 'stop', 'tensors', 'graph']);
    const frames = session.calls.filter((c) => c.command === 'evaluate').map((c) => c.args.frameId);
    assert.deepEqual(frames, [7, 7, 7, 9, 9, 9]);
  });
});
