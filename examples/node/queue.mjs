// The decision queue from Node.js over the Redis protocol (docs/PROTOCOL.md): submit through the queue's function
// library (FCALL dq_v1_submit: backpressure and checks, all or nothing), then block on each result stream.
//
//   npm install && node queue.mjs [--url redis://127.0.0.1:6379/0] [--namespace dq]
//   node queue.mjs --names NAMESPACE ID     prints the names this file uses (the tests compare them with keys.py)
//
// Prints one result JSON per line and exits 0 when every result is ok.

// The protocol's names (producer/wire/keys.py is their one definition; the tests hold this copy to it).
export const names = (namespace, id, lane = 'normal') => ({
  requests: `${namespace}:v1:{s0}:requests` + (lane === 'high' ? ':high' : ''),
  result: `${namespace}:v1:result:{${id}}`,
  submit: 'dq_v1_submit',
  body: 'body',
});

const flag = (name, fallback) => {
  const at = process.argv.indexOf(name);
  return at > 0 ? process.argv[at + 1] : fallback;
};

async function main() {
  if (process.argv.includes('--names')) {
    const at = process.argv.indexOf('--names');
    console.log(JSON.stringify(names(process.argv[at + 1], process.argv[at + 2], 'high')));
    return 0;
  }
  const { createClient } = await import('redis'); // installed by npm install: only this half needs it
  const namespace = flag('--namespace', 'dq');
  const client = createClient({ url: flag('--url', process.env.DQ_REDIS_URL || 'redis://127.0.0.1:6379/0') });
  client.on('error', (error) => console.error('redis:', error.message));
  await client.connect();
  const requests = ['Refund me, I was charged twice.', 'Thanks, all good.'].map((state, n) => ({
    id: `node-${process.pid}-${n}`, state, questions: { refund: { type: 'noul', instructions: 'Refund asked?' } },
    metadata: { from: 'node' },
  }));
  // One call for the batch: limit on unfinished entries (100000), then id and body per request.
  const args = ['100000', ...requests.flatMap((r) => [r.id, JSON.stringify(r)])];
  await client.fCall(names(namespace).submit, { keys: [names(namespace, '').requests], arguments: args });
  let ok = true;
  for (const request of requests) {
    const key = names(namespace, request.id).result;
    // A blocking read from the start of the result stream: no polling, and a result already there comes at once.
    const reply = await client.xRead({ key, id: '0-0' }, { BLOCK: 30000, COUNT: 1 });
    if (!reply) throw new Error(`no result for ${request.id} within 30 s`);
    const result = JSON.parse(reply[0].messages[0].message[names(namespace).body]);
    if (result.id !== request.id) throw new Error(`${key} holds a result for another id`);
    ok = ok && result.status === 'ok';
    console.log(JSON.stringify(result));
  }
  await client.quit();
  return ok ? 0 : 1;
}

main().then((code) => process.exit(code), (error) => { console.error(error.message); process.exit(2); });
