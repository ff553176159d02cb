// Small SVG histograms: inline ones beside each tensor of the list, a larger one (with its
// range) under the heatmap.
const SVG = 'http://www.w3.org/2000/svg';

export function histogramSvg(counts: readonly number[], width: number, height: number, title?: string): SVGSVGElement {
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('class', 'hist');
  svg.setAttribute('width', String(width));
  svg.setAttribute('height', String(height));
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  if (title) {
    const t = document.createElementNS(SVG, 'title');
    t.textContent = title;
    svg.appendChild(t);
  }
  const peak = Math.max(1, ...counts);
  const w = counts.length ? width / counts.length : width;
  counts.forEach((count, i) => {
    if (count <= 0) {
      return;
    }
    // sqrt scale, at least one pixel: a rare bin stays visible beside a huge one
    const h = Math.max(1, Math.round(Math.sqrt(count / peak) * height));
    const bar = document.createElementNS(SVG, 'rect');
    bar.setAttribute('x', (i * w).toFixed(2));
    bar.setAttribute('y', String(height - h));
    bar.setAttribute('width', Math.max(0.5, w - 0.5).toFixed(2));
    bar.setAttribute('height', String(h));
    svg.appendChild(bar);
  });
  return svg;
}
