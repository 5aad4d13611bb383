// The `replaybuf view` page: an episode list filtered by meta values, and for the picked
// episode its image fields as synced videos (rendered by the server on first request) and
// its scalar / small-vector fields as plots following the frame cursor.

import { CONTROLS_HTML, Player, fetchJson, playerElements } from './player.js';
import { SeriesPlot } from './plot.js';

const MAX_ROWS = 1000;
const COMPARISONS = {
  '>=': (a, b) => a >= b, '<=': (a, b) => a <= b, '!=': (a, b) => a !== b,
  '=': (a, b) => a === b, '>': (a, b) => a > b, '<': (a, b) => a < b,
};

const $ = (id) => document.getElementById(id);

function display(value) {
  if (Array.isArray(value)) return `[${value.map(display).join(', ')}]`;
  if (value === null) return 'nan';
  if (typeof value === 'number' && !Number.isInteger(value)) return value.toFixed(3);
  return String(value);
}

// a filter term: "3", ">0.5", "!=0", "true", or any text matched as a substring
function matcher(term) {
  term = term.trim();
  if (!term) return () => true;
  const parsed = /^(>=|<=|!=|=|>|<)\s*(.*)$/.exec(term);
  const [operator, operand] = parsed ? [parsed[1], parsed[2].trim()] : ['=', term];
  const number = Number(operand);
  if (operand !== '' && Number.isFinite(number)) {
    return (value) => {
      if (Array.isArray(value)) return value.some((item) => COMPARISONS[operator](Number(item), number));
      return value !== null && COMPARISONS[operator](Number(value), number);
    };
  }
  const needle = operand.toLowerCase();
  const contains = (value) => display(value).toLowerCase().includes(needle);
  return operator === '!=' ? (value) => !contains(value) : contains;
}

class Browser {
  constructor(info, episodes) {
    this.info = info;
    this.episodes = episodes;
    this.columns = ['#', 'len', ...episodes.columns];
    this.filters = this.columns.map(() => () => true);
    this.visible = [];
    this.selected = null;
    this.request = 0;
    this.plots = [];
    $('controls').innerHTML = CONTROLS_HTML;
    this.player = new Player(playerElements(), {
      fps: info.fps,
      onFrame: (frame) => this.plots.forEach((plot) => plot.setCursor(frame)),
    });
    $('plots').addEventListener('wheel', (event) => {
      if (event.target.closest('.plot-canvas')) this.player.onWheel(event);
    }, { passive: false });
    window.addEventListener('keydown', (event) => this.onKey(event));
    this.buildTable();
  }

  // by position, not name: a meta field may be called 'len' too
  value(index, position) {
    if (position === 0) return index;
    if (position === 1) return this.episodes.lengths[index];
    return this.episodes.meta[this.episodes.columns[position - 2]][index];
  }

  buildTable() {
    $('location').textContent = `${this.info.location} \u00b7 ${this.episodes.num_episodes} episodes`;
    for (const [position, column] of this.columns.entries()) {
      const header = document.createElement('th');
      header.textContent = column;
      $('episode-columns').append(header);
      const cell = document.createElement('th');
      const input = document.createElement('input');
      input.type = 'text';
      input.placeholder = column === '#' ? '' : 'filter';
      input.dataset.column = column;
      input.addEventListener('input', () => {
        this.filters[position] = matcher(input.value);
        this.renderRows();
      });
      cell.append(input);
      $('episode-filters').append(cell);
    }
    $('episode-rows').addEventListener('click', (event) => {
      const row = event.target.closest('tr');
      if (row) this.select(Number(row.dataset.index));
    });
    this.renderRows();
  }

  renderRows() {
    const count = this.episodes.slots;
    this.visible = [];
    for (let index = 0; index < count; index += 1) {
      if (this.filters.every((filter, position) => filter(this.value(index, position)))) {
        this.visible.push(index);
      }
    }
    const rows = this.visible.slice(0, MAX_ROWS).map((index) => {
      const row = document.createElement('tr');
      row.dataset.index = String(index);
      row.classList.toggle('selected', index === this.selected);
      for (const position of this.columns.keys()) {
        const cell = document.createElement('td');
        cell.textContent = display(this.value(index, position));
        row.append(cell);
      }
      return row;
    });
    $('episode-rows').replaceChildren(...rows);
    const shown = Math.min(this.visible.length, MAX_ROWS);
    $('episode-count').textContent = shown < this.visible.length
      ? `showing ${shown} of ${this.visible.length} matching (${count} episodes); filter to narrow`
      : `${this.visible.length} of ${count} episodes`;
  }

  async select(index) {
    const request = (this.request += 1);
    this.selected = index;
    for (const row of $('episode-rows').children) {
      const isSelected = Number(row.dataset.index) === index;
      row.classList.toggle('selected', isSelected);
      if (isSelected) row.scrollIntoView({ block: 'nearest' });
    }
    history.replaceState(null, '', `#episode=${index}`);
    const status = $('status');
    status.className = 'status';
    status.textContent = `loading episode ${index}\u2026`;
    let episode;
    try {
      episode = await fetchJson(`/api/episodes/${index}`);
    } catch (error) {
      if (request !== this.request) return;
      status.textContent = `episode ${index}: ${error.message}`;
      status.classList.add('error');
      return;
    }
    if (request !== this.request) return;
    this.show(episode);
    status.textContent = episode.length ? '' : `episode ${index} is empty`;
  }

  show(episode) {
    const header = $('episode-header');
    const title = document.createElement('strong');
    title.textContent = `episode ${episode.index}`;
    const length = document.createElement('span');
    length.textContent = `${episode.length} steps`;
    const meta = document.createElement('span');
    meta.className = 'meta';
    meta.textContent = Object.entries(episode.meta).map(([name, value]) => `${name}=${display(value)}`).join('  ');
    header.replaceChildren(title, length, meta);
    header.dataset.episode = String(episode.index);

    this.plots.forEach((plot) => plot.remove());
    const series = episode.length ? Object.entries(episode.series) : [];
    this.plots = series.map(([name, values]) =>
      new SeriesPlot($('plots'), name, values, {
        onSeek: (frame) => this.player.seek(frame), stride: episode.series_stride ?? 1, steps: episode.length,
      }));
    const sources = Object.entries(episode.videos).map(([name, src]) => ({ name, src }));
    this.player.load(sources, episode.length);
  }

  move(direction) {
    if (!this.visible.length) return;
    const position = this.visible.indexOf(this.selected);
    const next = position < 0 ? 0 : Math.max(0, Math.min(this.visible.length - 1, position + direction));
    if (this.visible[next] !== this.selected) this.select(this.visible[next]);
  }

  onKey(event) {
    if (event.target.matches?.('input[type=text], textarea, select')) return;
    const moves = { ArrowUp: -1, ArrowDown: 1, k: -1, j: 1, PageUp: -10, PageDown: 10 };
    if (event.key in moves && !event.ctrlKey && !event.metaKey && !event.altKey) {
      event.preventDefault();
      this.move(moves[event.key]);
    }
  }
}

async function main() {
  try {
    const [info, episodes] = await Promise.all([fetchJson('/api/info'), fetchJson('/api/episodes')]);
    const browser = new Browser(info, episodes);
    window.viewer = { info, browser, player: browser.player };
    const fromHash = /episode=(\d+)/.exec(location.hash);
    const first = fromHash ? Number(fromHash[1]) : browser.visible[0];
    if (first !== undefined && first < episodes.slots) await browser.select(first);
  } catch (error) {
    $('status').textContent = `could not load the buffer: ${error.message}`;
    $('status').classList.add('error');
  }
}

main();
