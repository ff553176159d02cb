// webview/model.ts: what each message does to the panel's state (banner, list, slice).
import { describe, it } from 'node:test';
import * as assert from 'node:assert/strict';
import * as stopFixture from './fixtures/stop.json';
import * as frameFixture from './fixtures/frame.json';
import * as sliceFixture from './fixtures/tensor_nan.json';
import type { GraphPayload, StopInfo, TensorEntry, TensorSlice, ToWebview } from '../src/messages';
import { isFromWebview, isToWebview } from '../src/messages';
import { INITIAL_STATE, bannerFor, bannerText, dataText, formatNumber, formatSummary, nodeRequest, reduce, requestToRepeat, sliceSummary, toggled } from '../src/webview/model';

const stop = stopFixture.stop as StopInfo;
const tensors = frameFixture.tensors as TensorEntry[];
const slice = sliceFixture as unknown as TensorSlice;
const request = { expr: 'w' };
const tensorMessage: ToWebview = { command: 'tensor', slice, request };
const pause = { reason: 'exception', file: '/ws/nan_prog.py', line: 6, function: '<module>' };

function apply(...messages: ToWebview[]) {
  return messages.reduce(reduce, INITIAL_STATE);
}

describe('stop message', () => {
  it('makes a banner with reason, op, module, file:line and stage', () => {
    const state = apply({ command: 'stop', stop, pause });
    assert.equal(state.banner.kind, 'stop');
    assert.equal(state.banner.title, 'Stopped: NaN');
    assert.deepEqual(state.banner.details, ['op aten.sub.Tensor', 'module model.head', 'nan_prog.py:6', 'stage forward', 'step 3']);
    assert.match(bannerText(state.banner), /^Stopped: NaN — op aten\.sub\.Tensor — module model\.head — nan_prog\.py:6/);
  });
  it('says Paused for a plain breakpoint, with where', () => {
    assert.deepEqual(bannerFor(null, { reason: 'breakpoint', file: '/ws/a.py', line: 3, function: 'step' }),
      { kind: 'paused', title: 'Paused', details: ['a.py:3 in step'], message: undefined });
    assert.equal(bannerFor({ reason: 'breakpoint', file: '/ws/a.py', line: 3 }, pause).title, 'Paused');
  });
  it('names the sample a NaN came in with', () => {
    const withData = { ...stop, data: { variable: 'x', rows: [7], dataset_indices: [77] } };
    assert.ok(bannerFor(withData, pause).details.includes('data x row 7 (dataset index 77)'));
    assert.ok(bannerFor({ ...stop, rank: 0 }, pause).details.includes('rank 0'));
    assert.equal(dataText({ variable: null, rows: [1, 2, 3, 4, 5, 6], dataset_indices: null }),
      'the batch rows 1, 2, 3, 4, 5 and 1 more');
  });
  it('shows the hint once, on its own line, and keeps the message without it', () => {
    const hint = 'a division by zero (0/0): the divisor `std` is 0; fix at prep.py:9: add an eps';
    const withHint = { ...stop, message: `32 NaN from aten.div.Tensor at prep.py:9 [forward]; hint: ${hint}`, hint };
    const banner = bannerFor(withHint, pause);
    assert.equal(banner.hint, hint);
    assert.equal(banner.message, '32 NaN from aten.div.Tensor at prep.py:9 [forward]');
    assert.match(bannerText(banner), /— Hint: a division by zero \(0\/0\)/);
    assert.equal(bannerFor({ ...stop, hint: '' }, pause).hint, undefined);
  });
  it('names other DAP reasons', () => {
    assert.equal(bannerFor(null, { reason: 'exception', description: 'ZeroDivisionError' }).title, 'Paused (exception)');
  });
  it('clears an earlier error', () => {
    const state = apply({ command: 'error', message: 'boom' }, { command: 'stop', stop, pause });
    assert.equal(state.error, null);
  });
});

describe('tensors message', () => {
  it('becomes the list, in order', () => {
    const state = apply({ command: 'stop', stop, pause }, { command: 'tensors', tensors });
    assert.deepEqual(state.tensors.map((t) => t.name), ['w', 'x', 'y']);
    assert.match(state.tensors[0].line, /^tensor\[4, 6\]/);
  });
  it('asks again for the shown tensor when it is still in the frame', () => {
    const state = apply(tensorMessage, { command: 'stop', stop, pause }, { command: 'tensors', tensors });
    assert.deepEqual(requestToRepeat(state), request);
    const elsewhere = apply(tensorMessage, { command: 'stop', stop, pause }, { command: 'tensors', tensors: tensors.slice(1) });
    assert.equal(requestToRepeat(elsewhere), null);
    assert.equal(requestToRepeat(apply({ command: 'tensors', tensors }, tensorMessage)), null, 'not stale: no repeat');
  });
});

describe('tensor, running and ended messages', () => {
  it('a slice is shown with the request that asked for it, and the list line as its summary', () => {
    const grad = { expr: 'w', grad: true };
    const state = apply({ command: 'tensors', tensors }, { command: 'tensor', slice, request: grad });
    assert.equal(state.slice?.name, 'w');
    assert.deepEqual(state.request, grad);
    assert.equal(sliceSummary(state), tensors[0].line);
  });
  it('builds a summary line when the list does not have the tensor', () => {
    assert.equal(sliceSummary(apply(tensorMessage)), 'tensor[4, 6] f32 x\u2208[-1, 1.3] \u03bc=0.119 \u03c3=0.7353 NaN\u00d71 +Inf\u00d71 -Inf\u00d71');
    assert.equal(formatSummary({ shape: [2], dtype: 'bf16', device: 'cuda:0', nan: 2 }), 'tensor[2] bf16 cuda:0 NaN\u00d72');
  });
  it('running keeps the list, ended clears everything', () => {
    const running = apply({ command: 'tensors', tensors }, { command: 'running' });
    assert.equal(running.banner.kind, 'running');
    assert.equal(running.tensors.length, 3);
    const ended = reduce(running, { command: 'ended' });
    assert.equal(ended.banner.title, 'Session ended');
    assert.deepEqual(ended.tensors, []);
  });
});

describe('graph messages', () => {
  const graph: GraphPayload = {
    item: {}, note: '4 module calls', expanded: ['root#0'], marked: ['head#0'], modules: 4,
    bokeh: { version: '3.9.2', js: ['/py/bokeh.min.js'] },
  };
  it('a graph is kept with its note; none says why; a stop and running keep it, ended clears it', () => {
    const state = apply({ command: 'graph', graph }, { command: 'stop', stop, pause }, { command: 'running' });
    assert.equal(state.graph, graph);
    assert.equal(state.graphNote, '4 module calls');
    const none = reduce(state, { command: 'graph', graph: null, note: 'No forward pass seen yet.' });
    assert.equal(none.graph, null);
    assert.equal(none.graphNote, 'No forward pass seen yet.');
    const ended = reduce(state, { command: 'ended' });
    assert.equal(ended.graph, null);
    assert.equal(ended.graphNote, '');
  });
  it('a toggle opens or closes one module; a node asks for its output by id', () => {
    assert.deepEqual(toggled(['root#0'], 'fc#0'), ['root#0', 'fc#0']);
    assert.deepEqual(toggled(['root#0', 'fc#0'], 'root#0'), ['fc#0']);
    assert.deepEqual(nodeRequest('head#0', 'head (Head) [2, 3] f32 NaN/Inf!'), { expr: 'head', node: 'head#0' });
    assert.deepEqual(nodeRequest('root#0', '(root) (Net) [2, 3] f32'), { expr: '(root)', node: 'root#0' });
  });
  it('a node\'s slice is not asked again at the next stop (its output belongs to that pass)', () => {
    const state = apply({ command: 'tensors', tensors }, { command: 'tensor', slice, request: { expr: 'head', node: 'head#0' } },
      { command: 'stop', stop, pause }, { command: 'tensors', tensors });
    assert.equal(requestToRepeat(state), null);
  });
});

describe('message guards', () => {
  it('accept the commands of their direction only', () => {
    assert.ok(isToWebview({ command: 'graph', graph: null }));
    assert.ok(isFromWebview({ command: 'requestGraph', expanded: [] }));
    assert.ok(!isToWebview({ command: 'requestGraph', expanded: [] }));
    assert.ok(isToWebview({ command: 'stop', stop: null, pause }));
    assert.ok(!isToWebview({ command: 'requestTensor' }));
    assert.ok(isFromWebview({ command: 'requestTensor', request: { expr: 'x' } }));
    assert.ok(!isFromWebview({ command: 'tensors' }) && !isFromWebview(null) && !isFromWebview('ready'));
  });
});

describe('formatNumber', () => {
  it('is short and spells out NaN and Inf', () => {
    assert.equal(formatNumber(1.23456), '1.235');
    assert.equal(formatNumber(1e-7), '1.000e-7');
    assert.equal(formatNumber(NaN), 'NaN');
    assert.equal(formatNumber(-Infinity), '-Inf');
    assert.equal(formatNumber(null), '\u2014');
  });
});
