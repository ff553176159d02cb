// Entry point: registers the `mldebug` debug type (debugpy's adapter, the configuration
// provider, the tracker that feeds the Tensors panel), the panel's serializer and the commands.
import * as vscode from 'vscode';
import { DebugpyAdapterFactory } from './adapter';
import { inspectVariable, openBrowserView } from './commands';
import { DEBUG_TYPE } from './config';
import { MlDebugConfigurationProvider } from './configProvider';
import { Inspector, PanelHost } from './inspector';
import type { FromWebview } from './messages';
import { TensorsPanel, VIEW_TYPE } from './panel';
import { trackerFactory } from './tracker';

export function activate(context: vscode.ExtensionContext): void {
  const output = vscode.window.createOutputChannel('mldebug');
  const log = (line: string): void => output.appendLine(`${new Date().toISOString()} ${line}`);

  // The page's requests go to the inspector; a page that (re)loads gets the last state.
  const onMessage = (message: FromWebview, panel: TensorsPanel): void => {
    if (message.command === 'ready') {
      inspector.replay(panel);
    } else if (message.command === 'requestTensor') {
      void inspector.requestTensor(message.request);
    } else if (message.command === 'requestGraph') {
      void inspector.requestGraph(message.expanded);
    }
  };
  const panels: PanelHost = {
    current: () => TensorsPanel.current(),
    show: () => TensorsPanel.createOrShow(context.extensionUri, onMessage),
  };
  const inspector = new Inspector(panels, log);

  context.subscriptions.push(
    output,
    vscode.debug.registerDebugAdapterDescriptorFactory(DEBUG_TYPE, new DebugpyAdapterFactory()),
    vscode.debug.registerDebugConfigurationProvider(DEBUG_TYPE, new MlDebugConfigurationProvider()),
    vscode.debug.registerDebugAdapterTrackerFactory(DEBUG_TYPE, trackerFactory(inspector, log)),
    vscode.window.registerWebviewPanelSerializer(VIEW_TYPE, {
      async deserializeWebviewPanel(panel: vscode.WebviewPanel): Promise<void> {
        TensorsPanel.revive(panel, context.extensionUri, onMessage);
      },
    }),
    vscode.debug.onDidChangeActiveStackItem((item) => {
      if (item instanceof vscode.DebugStackFrame && item.session.type === DEBUG_TYPE) {
        void inspector.selectFrame(item.session, item.frameId);
      }
    }),
    vscode.commands.registerCommand('mldebug.showTensors', () => { panels.show(); }),
    vscode.commands.registerCommand('mldebug.inspectVariable', (arg?: Parameters<typeof inspectVariable>[1]) => inspectVariable(inspector, arg)),
    vscode.commands.registerCommand('mldebug.openBrowserView', () => openBrowserView(inspector)),
    { dispose: () => TensorsPanel.current()?.dispose() },
  );
}

export function deactivate(): void {
  // Everything is in context.subscriptions.
}
