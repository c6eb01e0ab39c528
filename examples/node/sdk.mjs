// The official System One SDK for JavaScript (@typesafe-ai/sdk: npm install) against the gateway, with nothing
// changed but where it calls: its base URL and a key (any value where the gateway has no keys), from the SDK's own
// variables or flags.
//
//   TYPESAFE_BASE_URL=http://localhost:8080 TYPESAFE_API_KEY=any-value node sdk.mjs [--model NAME]
//
// (Node 20 or newer: the SDK's minimum; the other examples run on 18.)
// Calls the default model (jev-latest unless TYPESAFE_DEFAULT_MODEL or --model says otherwise) with every question
// type, sends an image inline (the SDK sends JSON only), makes 20 calls at once, lists the models and names a model
// nobody serves (the SDK's NotFoundError). Prints one JSON line per step; exits 0 when each went as it should.
import { choice, NotFoundError, noul, score, TypeSafeClient } from '@typesafe-ai/sdk';

const flag = (name) => {
  const at = process.argv.indexOf(name);
  return at > 0 ? process.argv[at + 1] : undefined;
};
const client = new TypeSafeClient({ baseURL: flag('--url'), apiKey: flag('--token'), defaultModel: flag('--model') });
// A 16x16 red PNG.
const png = 'iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAAGklEQVR42mO8IyLCQApgYiARjGoY1TB0NAAATz0BJHAVIksAAAAASUVORK5CYII=';
const questions = {
  refund: noul('Is a refund requested?'),
  tone: choice('What is the tone?', { calm: null, angry: 'An upset message' }),
  urgency: score('How urgent?', ['Can wait', 'This week', { level: 'Today' }]),
};

async function main() {
  const lines = [];
  const show = (line) => { console.log(JSON.stringify(line)); lines.push(line); };
  const text = await client.systemOne({ state: { message: 'I was charged twice.', channel: 'email' }, questions });
  show({ step: 'questions', ok: ['noul', 'choice', 'score'].every((t, n) => Object.values(text.answers)[n]?.type === t),
    model: text.model, answers: text.answers });
  const image = await client.systemOne({
    state: 'A photo of the parcel: IMG_1',
    questions: { red: noul('Is the photo mostly red?') },
    assets: { IMG_1: { type: 'image', format: 'png', data_base64: png } },
  });
  show({ step: 'image', ok: typeof image.answers.red?.noul === 'number', answer: image.answers.red });
  const many = await Promise.all(Array.from({ length: 20 }, (_, n) => client.systemOne({
    state: `Call ${n}: refund me.`, questions: { refund: questions.refund } })));
  show({ step: 'concurrent', ok: many.every((r) => typeof r.answers.refund.noul === 'number'), calls: many.length });
  const models = await client.models.list();
  show({ step: 'models', ok: models.some((m) => m.name === client.defaultModel), names: models.map((m) => m.name) });
  try {
    await client.systemOne({ model: 'no-such-model', state: 'x', questions: { q: noul('ok?') } });
    show({ step: 'not_found', ok: false });
  } catch (error) {
    show({ step: 'not_found', ok: error instanceof NotFoundError && error.status === 404, message: error.message });
  }
  return lines.every((line) => line.ok) ? 0 : 1;
}

main().then((code) => process.exit(code), (error) => { console.error(error.message); process.exit(2); });
