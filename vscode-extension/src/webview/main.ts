// Entry point of the Tensors panel page: restores the saved state (getState), applies each
// message from the extension to it (model.reduce), saves it (setState) and redraws; asks the
// extension for tensors (a graph node's output too) and for the graph with a module opened or
// closed through postMessage. Says 'ready' once, so the extension can replay.
import { FromWebview, isToWebview, TensorRequest } from '../messages';
import { INITIAL_STATE, nodeRequest, PanelState, reduce, requestToRepeat, toggled } from './model';
import { render } from './view';

interface VsCodeApi {
  postMessage(message: FromWebview): void;
  getState(): PanelState | undefined;
  setState(state: PanelState): void;
}
declare function acquireVsCodeApi(): VsCodeApi;

const vscode = acquireVsCodeApi();
let state: PanelState = { ...INITIAL_STATE, ...(vscode.getState() ?? {}) };

const actions = {
  request(request: TensorRequest): void {
    state = { ...state, request };
    vscode.setState(state);
    vscode.postMessage({ command: 'requestTensor', request });
  },
  node(id: string, label: string): void {
    actions.request(nodeRequest(id, label));
  },
  toggle(id: string): void {
    vscode.postMessage({ command: 'requestGraph', expanded: toggled(state.graph?.expanded ?? [], id) });
  },
};

window.addEventListener('message', (event: MessageEvent<unknown>) => {
  const message = event.data;
  if (!isToWebview(message)) {
    return;
  }
  state = reduce(state, message);
  vscode.setState(state);
  render(state, actions);
  if (message.command === 'tensors') {
    const again = requestToRepeat(state);      // keep showing the selected tensor at each stop
    if (again) {
      state = { ...state, stale: false };
      vscode.setState(state);
      vscode.postMessage({ command: 'requestTensor', request: again });
    }
  }
});

render(state, actions);
vscode.postMessage({ command: 'ready' });
