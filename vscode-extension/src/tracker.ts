// Watches the DAP traffic of every mldebug session and tells the Inspector when the program
// stops, runs again or ends. The one place where adapter messages become panel updates.
import * as vscode from 'vscode';
import type { Inspector, StoppedBody } from './inspector';
import type { StopInfo } from './messages';

interface DapMessage {
  type?: string;
  event?: string;
  command?: string;
  body?: unknown;
}

const RESUMING_REQUESTS: ReadonlySet<string> = new Set(['continue', 'next', 'stepIn', 'stepOut', 'stepBack', 'reverseContinue', 'goto']);

export function trackerFactory(inspector: Inspector, log: (line: string) => void): vscode.DebugAdapterTrackerFactory {
  return {
    createDebugAdapterTracker(session: vscode.DebugSession): vscode.DebugAdapterTracker {
      return {
        onDidSendMessage(message: DapMessage): void {
          if (message.type !== 'event') {
            return;
          }
          if (message.event === 'mldebug.stop') {
            const stop = (message.body as { stop?: StopInfo } | undefined)?.stop;
            if (stop) {
              inspector.onStopEvent(session, stop);
            }
          } else if (message.event === 'stopped') {
            void inspector.onStopped(session, message.body as StoppedBody);
          } else if (message.event === 'continued') {
            inspector.running(session);
          } else if (message.event === 'terminated' || message.event === 'exited') {
            inspector.ended(session);
          }
        },
        onWillReceiveMessage(message: DapMessage): void {
          if (message.type === 'request' && message.command && RESUMING_REQUESTS.has(message.command)) {
            inspector.running(session);
          }
        },
        onError: (error: Error) => log(`adapter error: ${error.message}`),
        onExit: (code: number | undefined, signal: string | undefined) => {
          log(`adapter exited: code=${code} signal=${signal}`);
          inspector.ended(session);
        },
      };
    },
  };
}
