package scheduling

import (
	"cmp"
	"context"
	"encoding/json"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// Several models may share a pool: each engine lists what it serves at GET
// /v1/models, in OpenAI's {"data": [{"id": ...}]}: vLLM every name it serves
// its model under and its LoRA adapters (OpenAIServingModels.
// show_available_models), SGLang its served model name. Every pool asks
// each of its engines as it joins, every minute after and after it was
// ejected, and a request naming a model that some endpoints of the pool list
// and others do not goes only to those that list it. A model every endpoint
// serves (one model) or none lists (an adapter loaded since the last read, a
// request naming none) may go to any, as before the lists were read; an
// engine whose --api-key guards its list is taken to serve every model
// (blind).
const (
	modelsRetry      = 30 * time.Second // a failed read of an engine that never answered is asked again after this
	maxModelsAnswer  = 4 << 20
	maxModelsPerList = 4096 // names kept of one list; the rest are cut
)

// servedModels is what an engine last listed, or why it listed nothing.
type servedModels struct {
	names map[string]json.RawMessage // each name's card as the engine gave it
	// lengths are the names' context lengths (contextLengths), read as the
	// list is rather than from the cards at each request.
	lengths map[string]int64
	err     string // why the last read failed; "" when it did not
	// answered: the engine listed its models once; a failed read of it is
	// asked again soon (it restarts), of one that never did (vLLM's
	// --api-key guards the list) after modelsRetry.
	answered bool
	at       time.Time
	// ejections is the endpoint's count when it was read: an engine taken
	// out of rotation since is asked again at once (it may have restarted
	// with another model).
	ejections uint64
}

// Models is how many names (models and adapters) the engine listed at its
// last answer: 0 before one.
func (e *Endpoint) Models() int {
	if m := e.models.Load(); m != nil {
		return len(m.names)
	}
	return 0
}

// MaxModelLen is the context length the engine listed for model at its
// last answer (servedModels.lengths). False when it listed none.
func (e *Endpoint) MaxModelLen(model string) (int64, bool) {
	if m := e.models.Load(); m != nil {
		n, ok := m.lengths[model]
		return n, ok
	}
	return 0, false
}

// serves says whether the engine may take a request naming model: it
// listed it, or its list could never be read (blind). One not read yet
// may not, where others list the model: it is asked as it joins.
func (e *Endpoint) serves(model string) bool {
	m := e.models.Load()
	if m == nil {
		return false
	}
	_, ok := m.names[model]
	return ok || m.blind()
}

// blind says the engine never answered for its list (vLLM's --api-key
// guards it): it is taken to serve any model, so that engines turning
// --api-key on one by one in a pool of one model are not left without
// requests meanwhile.
func (m *servedModels) blind() bool { return m.err != "" && !m.answered }

// modelCounts is what the endpoints of a pool state list: counted as the
// state is built and again when a list changes, so that a pick looks a
// model up once rather than on every endpoint.
type modelCounts struct {
	listed map[string]int // per name, the endpoints that list it
	blind  int            // the endpoints whose list could never be read
	// missed: a request named a name no list holds (an adapter loaded
	// since the last read): the lists are read again at the next round.
	missed atomic.Bool
}

func countModels(eps []*Endpoint) *modelCounts {
	c := modelCounts{listed: map[string]int{}}
	for _, e := range eps {
		m := e.models.Load()
		switch {
		case m == nil:
		case m.blind():
			c.blind++
		default:
			for n := range m.names {
				c.listed[n]++
			}
		}
	}
	return &c
}

// servingOnly is the name a request naming model is routed by, and whether
// it may go only to the endpoints of st that list that name: some list it,
// and others would not take it (a pool of one model filters nothing). A
// name no endpoint lists whole that reads "base:adapter" is routed by its
// base, as SGLang reads it (OpenAIServingBase._parse_model_parameter: split
// at the first colon, each part trimmed): an engine of another model
// answers it 404.
func (st *poolState) servingOnly(model string) (string, bool) {
	if model == "" {
		return "", false
	}
	c := st.models.Load()
	n := c.listed[model]
	if base, _, ok := strings.Cut(model, ":"); ok && n == 0 {
		model = strings.TrimSpace(base)
		n = c.listed[model]
	}
	if n == 0 && len(c.listed) > 0 && !c.missed.Load() {
		c.missed.Store(true)
	}
	return model, n > 0 && n+c.blind < len(st.endpoints)
}

// readModels asks the endpoints never read, or not for a while, for the
// models they serve; every one that answered before, once a request named
// a name none lists. An endpoint the active checks find down is left until
// it is up: a starting engine lists nothing.
func (p *Pool) readModels(ctx context.Context, st *poolState, eps []*Endpoint) {
	now := p.deps.Now()
	timeout := cmp.Or(st.spec.Health.CheckTimeout.D(), config.DefaultCheckTimeout)
	missed := p.state.Load().models.Load().missed.Swap(false)
	due := slices.DeleteFunc(slices.Clone(eps), func(e *Endpoint) bool {
		if e.CheckedDown() {
			return true
		}
		old := e.models.Load()
		if old == nil || old.ejections != e.ejections.Load() || missed && old.answered {
			return false
		}
		return now.Sub(old.at) < modelsRetryAfter(old)
	})
	var changed atomic.Bool
	probeEach(due, func(e *Endpoint) {
		old := e.models.Load()
		ejections := e.ejections.Load()
		m := fetchModels(ctx, p.probe, e.Addr, timeout)
		if ctx.Err() != nil {
			return
		}
		m.at, m.ejections, m.answered = now, ejections, m.err == "" || old != nil && old.answered
		if m.err != "" && old != nil {
			// Neither a hiccup nor a restart unlearns the list: an engine
			// restarts with the model it had, and is asked again in 5 s.
			m.names, m.lengths = old.names, old.lengths
		}
		e.models.Store(&m)
		if old == nil || !sameNames(old.names, m.names) {
			changed.Store(true)
		}
		p.logModels(e.Addr, old, &m)
	})
	if changed.Load() {
		p.recountModels()
	}
}

// recountModels counts the lists again for the pool's current state, once
// they changed. Under the pool's lock, as a rebuild counts and publishes its
// state: one that counted before a list changed has published by then, and
// is counted again here, not left with the old count.
func (p *Pool) recountModels() {
	p.mu.Lock()
	defer p.mu.Unlock()
	counted(p.state.Load())
}

// counted counts the lists of st's endpoints into st.
func counted(st *poolState) *poolState {
	st.models.Store(countModels(st.endpoints))
	return st
}

// modelsRetryAfter is how long a read stands: a minute, a failed one less.
func modelsRetryAfter(m *servedModels) time.Duration {
	switch {
	case m.err == "":
		return serverInfoRefresh
	case m.answered:
		return serverInfoEvery
	}
	return modelsRetry
}

// logModels says what changed: the list, or a read that began to fail.
func (p *Pool) logModels(addr string, old, m *servedModels) {
	log := p.deps.Log.WithValues("pool", p.Name(), "endpoint", addr)
	switch {
	case m.err != "" && (old == nil || old.err != m.err):
		// Debug: a pool of one model needs no list, and vLLM's --api-key
		// guards it (pd_extproc_endpoint_models stays 0).
		log.V(1).Info("cannot read the models the engine serves; until it answers once, it is taken to serve every model", "error", m.err)
	case m.err == "" && (old == nil || !sameNames(old.names, m.names)):
		log.Info("the models the engine serves", "models", slices.Sorted(maps.Keys(m.names)))
	}
}

// fetchModels asks the engine at addr for its model list.
func fetchModels(ctx context.Context, pr probe, addr string, timeout time.Duration) servedModels {
	url := pr.url(addr, api.ModelsPath)
	var list struct {
		Data []json.RawMessage `json:"data"`
	}
	if _, err := pr.getJSON(ctx, url, timeout, maxModelsAnswer, &list); err != nil {
		return servedModels{err: err.Error()}
	}
	names := make(map[string]json.RawMessage, min(len(list.Data), maxModelsPerList))
	cards := make(map[string]modelCard, len(names))
	for _, raw := range list.Data {
		var c modelCard
		if json.Unmarshal(raw, &c) == nil && c.ID != "" && len(names) < maxModelsPerList {
			names[c.ID], cards[c.ID] = raw, c
		}
	}
	if len(names) == 0 {
		return servedModels{err: url + " lists no model"}
	}
	return servedModels{names: names, lengths: contextLengths(cards)}
}

// modelCard is what a model card tells the pools: its name, and its context
// length (vLLM's ModelCard, filled by OpenAIServingModels.show_available_models;
// null for an adapter, whose parent is the base model).
type modelCard struct {
	ID          string `json:"id"`
	MaxModelLen int64  `json:"max_model_len"`
	Parent      string `json:"parent"`
}

// contextLengths are the max_model_len of each card, an adapter's its
// parent's. A name whose card states none has none.
func contextLengths(cards map[string]modelCard) map[string]int64 {
	lengths := map[string]int64{}
	for name, c := range cards {
		if c.MaxModelLen <= 0 && c.Parent != "" {
			c.MaxModelLen = cards[c.Parent].MaxModelLen
		}
		if c.MaxModelLen > 0 {
			lengths[name] = c.MaxModelLen
		}
	}
	return lengths
}

// sameNames says whether two lists name the same models, whatever their cards.
func sameNames(a, b map[string]json.RawMessage) bool {
	return maps.EqualFunc(a, b, func(json.RawMessage, json.RawMessage) bool { return true })
}

// ModelList is what the pool's engines serve together: each name once,
// with its card as an endpoint listing it gave it, in the order of the
// names; ok is false when every endpoint read lists the same names (a pool
// of one model) or none was read, where one engine's own list is the
// pool's.
func (p *Pool) ModelList() (cards []json.RawMessage, ok bool) {
	var first map[string]json.RawMessage
	all := map[string]json.RawMessage{}
	for _, e := range p.state.Load().endpoints {
		m := e.models.Load()
		if m == nil || len(m.names) == 0 {
			continue
		}
		if first == nil {
			first = m.names
		}
		ok = ok || !sameNames(first, m.names)
		for n, card := range m.names {
			if _, seen := all[n]; !seen {
				all[n] = card
			}
		}
	}
	if !ok {
		return nil, false
	}
	for _, n := range slices.Sorted(maps.Keys(all)) {
		cards = append(cards, all[n])
	}
	return cards, true
}

// scope is which of a pool's endpoints a request may go to: those in its
// subset hint (the decode pool's only) and, where some endpoints list its
// model and others do not, those that list it; else any serves it.
type scope struct {
	subset Subset
	model  string
	only   bool
}

func (p *Pool) scopeOf(st *poolState, req *Request) scope {
	var sc scope
	sc.model, sc.only = st.servingOnly(req.model())
	if p.decode() && req != nil {
		sc.subset = req.Subset
	}
	return sc
}

func (sc scope) admits(e *Endpoint) bool {
	return sc.subset.admits(e.ap) && (!sc.only || e.serves(sc.model))
}
