// The --serve page: pre-rendered videos of the chosen episodes, one per field, in sync.

import { CONTROLS_HTML, Player, fetchJson, playerElements } from './player.js';

function definitions(list, entries) {
  for (const [key, value] of entries) {
    const term = document.createElement('dt');
    term.textContent = key;
    const description = document.createElement('dd');
    description.textContent = Array.isArray(value) ? value.join(', ') : String(value);
    list.append(term, description);
  }
}

async function main() {
  document.getElementById('controls').innerHTML = CONTROLS_HTML;
  const status = document.getElementById('status');
  try {
    const info = await fetchJson('/api/info');
    definitions(document.getElementById('stats'), [
      ['buffer', info.location], ['episodes', info.episodes], ['frames', info.frames],
      ['fps', info.fps], ['scale', info.scale],
    ]);
    definitions(document.getElementById('field-stats'),
      info.fields.map((field) => [field.name, [field.shape, field.dtype].filter(Boolean).join(' ')]));
    const player = new Player(playerElements(), { fps: info.fps });
    player.load(info.fields.map((field) => ({ name: field.name, src: info.videos[field.name] })), info.frames,
      { autoplay: true });
    window.viewer = { info, player };
  } catch (error) {
    status.textContent = `could not load: ${error.message}`;
    status.classList.add('error');
  }
}

main();
