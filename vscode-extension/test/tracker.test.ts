// tracker.ts: which adapter messages reach the Inspector, and as what.
import { describe, it } from 'node:test';
import * as assert from 'node:assert/strict';
import type * as vscode from 'vscode';
import type { Inspector } from '../src/inspector';
import { trackerFactory } from '../src/tracker';

function recordingInspector() {
  const calls: string[] = [];
  const inspector = {
    onStopped: async (_s: unknown, body: { reason: string }) => { calls.push(`stopped:${body.reason}`); },
    onStopEvent: (_s: unknown, stop: { reason: string }) => { calls.push(`event:${stop.reason}`); },
    running: () => { calls.push('running'); },
    ended: () => { calls.push('ended'); },
  };
  return { calls, inspector: inspector as unknown as Inspector };
}

describe('the adapter tracker', () => {
  it('turns DAP events and resuming requests into inspector calls', () => {
    const { calls, inspector } = recordingInspector();
    const tracker = trackerFactory(inspector, () => undefined)
      .createDebugAdapterTracker({ id: 's1', type: 'mldebug' } as vscode.DebugSession) as vscode.DebugAdapterTracker;
    tracker.onDidSendMessage?.({ type: 'event', event: 'output', body: { output: 'x' } });
    tracker.onDidSendMessage?.({ type: 'event', event: 'mldebug.stop', body: { stop: { reason: 'nan' } } });
    tracker.onDidSendMessage?.({ type: 'event', event: 'stopped', body: { reason: 'exception', threadId: 1 } });
    tracker.onWillReceiveMessage?.({ type: 'request', command: 'evaluate' });
    tracker.onWillReceiveMessage?.({ type: 'request', command: 'next' });
    tracker.onDidSendMessage?.({ type: 'event', event: 'continued', body: {} });
    tracker.onDidSendMessage?.({ type: 'event', event: 'terminated' });
    tracker.onExit?.(0, undefined);
    assert.deepEqual(calls, ['event:nan', 'stopped:exception', 'running', 'running', 'ended', 'ended']);
  });
});
